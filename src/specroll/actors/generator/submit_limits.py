"""What a generator accepts in a ``SubmitGroup`` or an ``Abort``: every count and size bounded by
its engine's own limits, checked when the message arrives, before a sample is built or anything
is queued. A group over a bound is refused whole with an ``Error`` naming the field, its value
and the limit; the generator goes on serving.

Bounds (the engine's, so nothing a trainer may legitimately send is refused):

* samples started (``n``, or ``len(resume)`` when resuming) <= ``max_num_seqs``: a larger group
  could never decode at once, and the trainer dispatches by the free sequences heartbeats report;
* ``len(prompt_token_ids)`` + a resumed sample's tokens < the context (one token of room, as
  ``Engine.add_request`` requires), and each resumed sample's tokens <= ``max_tokens`` and <= the
  context; a ``sampling.max_tokens`` above the context is accepted (the engine ends the response
  at the context with ``"length"``, so the work stays bounded by it);
* every token id in the model's vocabulary;
* the protocol's absolute limits (``protocol/limits.py``): id length, stop tokens, group size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specroll.engine.engine import Engine
from specroll.protocol.limits import (
    MAX_GROUP_SIZE,
    MAX_ID_CHARS,
    MAX_STOP_TOKEN_IDS,
    LimitExceeded,
    check_at_most,
    check_token_ids,
)
from specroll.protocol.messages import Abort, SubmitGroup


def _shown(group_id: str) -> str:
    """The group id for an error message: at most 64 characters of it."""
    return repr(group_id) if len(group_id) <= 64 else f"{group_id[:64]!r}… ({len(group_id)} characters)"


@dataclass(frozen=True)
class SubmitLimits:
    """The bounds of one generator's engine (module docstring)."""

    max_num_seqs: int
    """``generator.engine.max_num_seqs``: sequences the engine decodes at once."""
    max_model_len: int
    """The context in tokens: prompt plus response."""
    vocab_size: int
    """Token ids are in ``[0, vocab_size)``."""

    @classmethod
    def of(cls, engine: Engine, max_num_seqs: int) -> SubmitLimits:
        """The bounds of ``engine`` (its context and vocabulary) decoding ``max_num_seqs`` sequences."""
        return cls(max_num_seqs, engine.max_model_len, engine.model_config.vocab_size)

    def max_header_bytes(self) -> int:
        """The longest message header a trainer may send this generator: a ``SubmitGroup`` that resumes
        ``max_num_seqs`` samples, each and the prompt a whole context long (msgpack: at most 9 bytes an
        integer, 9 a float, so 27 a resumed token: id, logprob, version), with room for the ids, the
        sampling (its stop tokens) and the other messages (4 MiB: a weight announcement names every
        tensor of the model). The channel refuses a longer header before decoding it; the socket
        takes no frame longer than it or the largest tensor."""
        tokens = 9 * self.max_model_len + self.max_num_seqs * (27 * self.max_model_len + 64)
        return tokens + (4 << 20)

    def check(self, msg: SubmitGroup | Abort) -> None:
        """Raise :class:`~specroll.protocol.limits.LimitExceeded` (the message names the group,
        the field, its value and the limit) unless every bound holds. Work: one pass over the token
        ids, and only once their counts were bounded by the context."""
        check_at_most(f"{type(msg).__name__}.len(group_id)", len(msg.group_id), MAX_ID_CHARS, "protocol limit")
        if isinstance(msg, SubmitGroup):
            try:
                self._check_submit(msg)
            except LimitExceeded as e:
                raise LimitExceeded(f"SubmitGroup {_shown(msg.group_id)}: {e}") from None

    def _check_submit(self, msg: SubmitGroup) -> None:
        seqs = "generator.engine.max_num_seqs"
        if msg.resume:
            check_at_most("n", msg.n, MAX_GROUP_SIZE, "protocol limit")
            check_at_most("len(resume)", len(msg.resume), self.max_num_seqs, seqs)
        else:
            check_at_most("n", msg.n, self.max_num_seqs, seqs)
        s = msg.sampling
        check_at_most("len(sampling.stop_token_ids)", len(s.stop_token_ids), MAX_STOP_TOKEN_IDS, "protocol limit")
        prompt = len(msg.prompt_token_ids)
        room = "max_model_len - 1: room for one response token"
        check_at_most("len(prompt_token_ids)", prompt, self.max_model_len - 1, room)
        for k, r in enumerate(msg.resume):
            field = f"len(resume[{k}].token_ids)"
            check_at_most(field, len(r.token_ids), min(s.max_tokens, self.max_model_len),
                          "sampling.max_tokens (which bounds the whole response) and the model's context")
            if len(r.token_ids) < s.max_tokens:  # decoding goes on: prompt and response must leave room
                check_at_most(f"len(prompt_token_ids) + {field}", prompt + len(r.token_ids), self.max_model_len - 1,
                              room)
        self._check_ids("prompt_token_ids", msg.prompt_token_ids)
        for k, r in enumerate(msg.resume):
            self._check_ids(f"resume[{k}].token_ids", r.token_ids)

    def _check_ids(self, field: str, ids: Sequence[int]) -> None:
        check_token_ids(field, ids, self.vocab_size)
