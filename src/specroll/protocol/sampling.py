"""Sampling parameters: shared by the engine, the CLI and (later) the wire protocol."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one request's tokens are drawn and when its generation stops.

    The processed distribution is ``softmax(logits / temperature)`` restricted to the ``top_k``
    most likely tokens and then to the smallest set whose probability reaches ``top_p``
    (renormalised); every sampled token's behavior logprob is taken under it.

    Raises:
        ValueError: on construction, naming the field, when a value is out of range.
    """

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables the filter."""
    top_p: float = 1.0
    """Nucleus filter in (0, 1]; 1 disables it."""
    max_tokens: int = 256
    """Most response tokens to generate."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens, whatever else is in the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the response (the emitted stop token is kept)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature}, expected a number >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}, expected >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}, expected a number in (0, 1]")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens={self.max_tokens}, expected a positive integer")

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax."""
        return self.temperature == 0


def sample_seed(group_seed: int, index: int, offset: int = 0) -> int:
    """The engine seed of sample ``index`` of a group submitted with ``SamplingParams.seed =
    group_seed``, for the request that continues it after ``offset`` response tokens (0: fresh).

    The n samples of a seeded group must not share one random stream, and a sample re-prefilled
    or resumed elsewhere draws a fresh one from where it stands; every generator derives seeds this
    way, and so does anything that must reproduce a generator's draws (the held-out evaluation run
    on a local engine, ``specroll.rl.evaluation.evaluate_engine``).
    """
    return hash((group_seed, index, offset)) & (2**63 - 1)
