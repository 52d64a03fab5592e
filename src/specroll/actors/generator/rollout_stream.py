"""Per-sample streaming state of the generator actor, and a proposer wrapper that counts drafts.

A :class:`SampleStream` holds what one sample (one request of a group) emitted but has not yet sent,
and where its next :class:`~specroll.protocol.messages.RolloutChunk` starts, so chunks stay
contiguous across resumes, recomputes and aborts: nothing is sent twice and nothing skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from specroll.engine.model import CausalLM
from specroll.engine.spec.proposer import DraftInput, FeatureUpdate, Proposal, Proposer, draft_cap
from specroll.protocol.messages import FinishReason, RolloutChunk, SpecStats
from specroll.protocol.sampling import SamplingParams


@dataclass
class SampleStream:
    """One sample of a group: its budget, its unsent response tokens and its chunk offset.

    The engine request behind it has prompt ``prompt_token_ids + response[:engine_base]``: a resumed
    sample, or one re-prefilled after a weight update (``kv_policy="recompute"``), continues from
    response tokens that were folded into its engine prompt.
    """

    group_id: str
    index: int
    prompt_token_ids: list[int]
    """The group's prompt (chat template applied), as the trainer sent it."""
    sampling: SamplingParams
    """The group's sampling; ``max_tokens`` bounds the whole response, resumed tokens included."""
    sent: int
    """Response tokens already in chunks: the next chunk's ``offset``."""
    engine_base: int
    """Response tokens folded into the engine request's prompt."""
    token_ids: list[int] = field(default_factory=list)
    """Emitted, not yet sent."""
    logprobs: list[float] = field(default_factory=list)
    """Behavior logprob (natural log) of each unsent token."""
    versions: list[int] = field(default_factory=list)
    """Policy version that produced each unsent token."""
    steps_waiting: int = 0
    """Engine steps since the oldest unsent token was emitted."""
    spec: SpecStats = field(default_factory=SpecStats)
    """Speculative counters of the steps since the last chunk."""

    @property
    def request_id(self) -> str:
        """The engine request id: ``"{group_id}/{index}"``."""
        return f"{self.group_id}/{self.index}"

    @property
    def num_response_tokens(self) -> int:
        """Response tokens so far: sent, unsent and resumed."""
        return self.sent + len(self.token_ids)

    @property
    def remaining(self) -> int:
        """Response tokens still allowed by ``max_tokens``."""
        return self.sampling.max_tokens - self.num_response_tokens

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Append one step's new tokens (aligned lists)."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def count_spec(self, drafted: int, emitted: int) -> None:
        """Fold one step's drafting into the chunk counters: each verify step emits the accepted
        drafts + one recovered or bonus token, so ``accepted = emitted - 1`` (a finishing step may
        stop early; then fewer are counted)."""
        if drafted:
            accepted = max(0, min(drafted, emitted - 1))
            self.spec = SpecStats(num_drafted=self.spec.num_drafted + drafted,
                                  num_accepted=self.spec.num_accepted + accepted,
                                  num_draft_steps=self.spec.num_draft_steps + 1)

    def take_chunk(self, finish_reason: FinishReason | None = None, *, speculative: bool = False,
                   drafter_version: int = 0) -> RolloutChunk:
        """A chunk of every unsent token (final when ``finish_reason`` is given); resets the buffer.
        With ``speculative`` it carries the counters of its steps, tagged with ``drafter_version``."""
        chunk = RolloutChunk(
            group_id=self.group_id, sample_index=self.index, offset=self.sent,
            token_ids=self.token_ids, logprobs=self.logprobs, versions=self.versions,
            finished=finish_reason is not None, finish_reason=finish_reason,
            spec=msgspec.structs.replace(self.spec, drafter_version=drafter_version) if speculative else None,
        )
        self.sent += len(self.token_ids)
        self.token_ids, self.logprobs, self.versions = [], [], []
        self.steps_waiting = 0
        self.spec = SpecStats()
        return chunk


class DraftCounter:
    """A :class:`~specroll.engine.spec.proposer.Proposer` that forwards to ``inner`` and records how many
    drafts of each request the engine verifies in a step (for per-chunk :class:`SpecStats`).

    The engine caps a row's drafts with :func:`~specroll.engine.spec.proposer.draft_cap` over the
    row's ``max_len``; the count here applies the same cap to the same row.
    """

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.feature_layers: tuple[int, ...] = tuple(inner.feature_layers)
        self.drafted: dict[str, int] = {}
        """request id → drafts verified in the last step (cleared by the actor after each step)."""

    def attach(self, target: CausalLM) -> None:
        self.inner.attach(target)

    def observe(self, updates: Sequence[FeatureUpdate]) -> None:
        self.inner.observe(updates)

    def finish(self, request_id: str) -> None:
        self.inner.finish(request_id)

    def propose(self, batch: Sequence[DraftInput], k: int) -> Proposal:
        proposal = self.inner.propose(batch, k)
        for row, n in zip(batch, proposal.num_drafts.tolist(), strict=True):
            cap = k if row.max_len is None else draft_cap(row.max_len, len(row.token_ids), k)
            self.drafted[row.request_id] = max(0, min(int(n), cap))
        return proposal
