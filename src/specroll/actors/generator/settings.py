"""A generator process's settings (:class:`GeneratorSettings`, which a TOML config layer maps onto)
and the engine they describe (:func:`build_engine`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from specroll.actors.generator.rollout_stream import DraftCounter
from specroll.engine.config import EngineConfig
from specroll.engine.engine import Engine
from specroll.protocol.channel import DEFAULT_WINDOW

KvPolicy = Literal["keep", "recompute"]
Speculative = Literal["off", "suffix", "eagle"]



@dataclass
class GeneratorSettings:
    """Everything a generator process needs (a TOML config layer maps onto this)."""

    connect: str
    """The trainer's ROUTER endpoint, e.g. ``tcp://127.0.0.1:5555``."""
    model: str
    """A registered model name, a Hugging Face checkpoint directory or a ``.gguf`` file."""
    actor_id: str = ""
    """Unique per process incarnation, also the ZeroMQ identity; empty: ``generator-<uuid4 hex>``."""
    max_num_seqs: int = 64
    """Most sequences decoded in one step; also the capacity announced in heartbeats."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and KV dtype of the engine."""
    speculative: Speculative = "off"
    """``suffix``: model-free drafts (``drafter/suffix.py``) verified losslessly; ``eagle``: a learned
    EAGLE head (``drafter``, and every version the drafter trainer publishes); ``off``: plain decoding."""
    drafter: str | None = None
    """With ``eagle``: a drafter directory to serve from the start (version 0); ``None``: decode
    plainly until the drafter trainer's first version arrives."""
    drafter_kv_cache_gb: float = 0.25
    """Memory for the EAGLE head's own K/V, in GiB."""
    num_draft_tokens: int = 4
    """Drafts per sequence and step when speculating (K)."""
    draft_length: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: K drafts every step; ``adaptive``: k in [0, K] chosen each step from measured tokens/s."""
    stream_every: int = 4
    """A sample with unsent tokens gets a chunk at least every this many engine steps."""
    heartbeat_s: float = 1.0
    """Seconds between heartbeats."""
    stats_s: float = 5.0
    """Seconds between ``Stats`` messages."""
    kv_policy: KvPolicy = "keep"
    """On a weight update: ``keep`` running requests' K/V, or ``recompute`` it under the new weights."""
    seed: int = 0
    """Engine seed for samples whose group brings no seed."""
    trainer_timeout_s: float = 60.0
    """Exit (code 3) after this many seconds with neither a connection to nor a message from the
    trainer; also the limit on the handshake."""
    linger_s: float = 1.0
    """On shutdown: seconds to flush unsent chunks and then to deliver ``Dead``."""
    kv_cache_gb: float = 1.0
    """KV-cache memory in GiB."""
    max_model_len: int | None = None
    """Context length cap in tokens; ``None`` takes the checkpoint's."""
    device: str = "cpu"
    """Torch device of the engine."""
    backend: Literal["auto", "torch", "flashinfer"] = "auto"
    """Attention backend."""
    num_threads: int | None = None
    """Torch intra-op CPU threads; ``None`` leaves torch's default."""
    window: int = DEFAULT_WINDOW
    """Credit window of the channel; must equal the trainer's."""
    max_outbox: int = 256
    """Messages queued for the trainer before the step loop waits (backpressure)."""

    def __post_init__(self) -> None:
        if not self.actor_id:
            self.actor_id = f"generator-{uuid.uuid4().hex}"
        for name in ("max_num_seqs", "num_draft_tokens", "stream_every", "max_outbox"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}, expected a positive integer")
        for name in ("heartbeat_s", "stats_s", "trainer_timeout_s", "linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}, expected a positive number of seconds")
        if self.kv_policy not in ("keep", "recompute"):
            raise ValueError(f"kv_policy={self.kv_policy!r}, expected 'keep' or 'recompute'")
        if self.speculative not in ("off", "suffix", "eagle"):
            raise ValueError(f"speculative={self.speculative!r}, expected 'off', 'suffix' or 'eagle'")
        if self.drafter is not None and self.speculative != "eagle":
            raise ValueError(f"drafter={self.drafter!r} needs speculative='eagle' (got {self.speculative!r})")


def build_engine(settings: GeneratorSettings) -> tuple[Engine, DraftCounter | None]:
    """The engine (and its draft counter when speculating) the settings describe.

    Raises:
        CheckpointError, ValueError: the model cannot be loaded or a setting is out of range.
        DrafterError: ``settings.drafter`` holds no drafter, or one made for another model.
    """
    config = EngineConfig(
        model=settings.model, backend=settings.backend, device=settings.device, dtype=settings.dtype,
        kv_cache_memory_gb=settings.kv_cache_gb, max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs, seed=settings.seed, num_threads=settings.num_threads,
        num_draft_tokens=settings.num_draft_tokens, draft_length=settings.draft_length,
    )
    counter = None
    if settings.speculative == "suffix":
        from specroll.drafter.suffix import SuffixProposer

        counter = DraftCounter(SuffixProposer())
    elif settings.drafter is not None:
        from specroll.drafter.eagle import EagleProposer

        counter = DraftCounter(EagleProposer(settings.drafter, kv_cache_memory_gb=settings.drafter_kv_cache_gb,
                                             page_size=config.page_size, seed=settings.seed))
    return Engine(config, proposer=counter), counter
