"""Continuous batching: which sequences run in the next step, and on how many tokens.

Each step has a token budget. Running sequences go first (a decode costs one token; a chunked
prefill in progress takes what is left of the budget), then waiting ones are admitted in arrival
order while the budget, ``max_num_seqs`` and free pages allow. When a running sequence cannot get
the page it needs, the most recently admitted sequence is preempted: its pages are freed and it
waits at the head of the queue to be recomputed from its prompt and the tokens it already has.
The policy follows vLLM v1's unified scheduler and nano-vllm's ``scheduler.py``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from specroll.engine.block_manager import BlockManager
from specroll.engine.sequence import Sequence, SequenceStatus
from specroll.engine.spec.proposer import draft_cap

log = logging.getLogger("specroll.engine")

LONG_PREFILL_STEPS = 8
"""A prompt that takes more steps than this to prefill under the token budget is worth a warning
(once per scheduler): each chunk is a step of its own, beside the decodes."""


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    """Tokens whose K/V this step computes: ``token_ids[num_computed : num_computed + n]``."""
    samples: bool
    """The step reaches the sequence's last token, so a new token is sampled. Fixed when scheduled:
    the step later advances ``num_computed_tokens``, after which it could not be derived."""

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        return cls(seq, num_new_tokens, seq.num_computed_tokens + num_new_tokens == seq.num_tokens)


class Scheduler:
    """Chooses each step's batch under a token budget and the free pages.

    Raises:
        ValueError: on construction when a limit is not positive.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}: "
                "expected positive integers"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._warned_long_prefill = False

    def add(self, seq: Sequence) -> None:
        steps = -(-seq.num_tokens // self.max_num_batched_tokens)
        if steps > LONG_PREFILL_STEPS and not self._warned_long_prefill:
            self._warned_long_prefill = True
            log.warning("a prompt of %d tokens takes %d steps to prefill under max_num_batched_tokens=%d; a larger "
                        "budget (--max-num-batched-tokens, generator.engine.max_num_batched_tokens) prefills it in "
                        "fewer, faster steps (warned once)", seq.num_tokens, steps, self.max_num_batched_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            assert seq.status is SequenceStatus.WAITING, f"{seq.request_id} is already finished"
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _computes_shared_pages(self, seq: Sequence) -> bool:
        ps = self.block_manager.page_size
        return seq.group_id is not None and seq.num_computed_tokens < (seq.prompt_len - 1) // ps * ps

    def schedule(self, version: int, lookahead: int = 0) -> list[ScheduledSequence]:
        """Pick the next step's batch.

        Args:
            version: weight version the step runs under (prefix-cache key).
            lookahead: the step's draft length k; each sequence that reaches its last token gets
                K/V slots for :func:`~specroll.engine.spec.proposer.draft_cap` drafts.

        Returns:
            The batch, running sequences first; empty when nothing can run.
        """
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        bm = self.block_manager
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or out of budget
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # K/V slots for the drafts this sequence may verify: the same cap the drafts get, so a
            # sequence near its length limit never asks for slots past it. (A last prefill chunk
            # reserves them too though it drafts only from its next step; the verify rolls them back.)
            remaining = num_new == seq.num_tokens - seq.num_computed_tokens
            extra = draft_cap(seq.max_len, seq.num_tokens, lookahead) if remaining else 0
            while not bm.grow(seq, seq.num_computed_tokens + num_new + extra):
                victim = self.running[-1]
                self._preempt(victim)
                budget += sum(s.num_new_tokens for s in scheduled if s.seq is victim)
                scheduled = [s for s in scheduled if s.seq is not victim]
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                scheduled.append(ScheduledSequence.of(seq, num_new))
                budget -= num_new
        # A request whose group has a member computing shareable prompt pages waits one step and
        # then takes those pages from the prefix cache: the group's prompt is prefilled once.
        prefilling = {s.seq.group_id for s in scheduled if self._computes_shared_pages(s.seq)}
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.group_id is not None and seq.group_id in prefilling:
                deferred.append(self.waiting.popleft())
                continue
            if not bm.allocate(seq, version):
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence.of(seq, num_new))
            budget -= num_new
            if self._computes_shared_pages(seq):
                prefilling.add(seq.group_id)
        self.waiting.extendleft(reversed(deferred))
        return scheduled
