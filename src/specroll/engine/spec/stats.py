"""Speculative-decoding counters: drafted, accepted, acceptance length, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculativeStats:
    """Speculative-decoding counters: of one step (``Engine.last_step_stats``) or summed over a
    run (``Engine.spec_stats``)."""

    num_steps: int = 0
    """Engine steps counted."""
    k: int = 0
    """Draft length chosen for the step (the last step's, in a sum)."""
    num_drafted: int = 0
    """Draft tokens verified."""
    num_accepted: int = 0
    """Draft tokens accepted."""
    num_draft_steps: int = 0
    """(sequence, step) pairs that verified at least one draft."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """Draft tokens accepted at each draft position (index 0: the first draft token; a tree's
    positions are depths), as vLLM's ``spec_decode_num_accepted_tokens_per_pos``."""
    num_emitted: int = 0
    """Tokens emitted by decoding sequences (accepted + one recovered or bonus token each)."""
    draft_time_s: float = 0.0
    """Seconds spent proposing."""
    verify_time_s: float = 0.0
    """Seconds of the target's forward pass and the rejection sampling."""

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per drafting (sequence, step): ``1 + accepted / draft steps`` (1.0 before any)."""
        return 1.0 + self.num_accepted / self.num_draft_steps if self.num_draft_steps else 1.0

    def count_verify(self, num_drafted: int, num_accepted: int) -> None:
        """Count one sequence's verify in a step: ``num_accepted`` of its ``num_drafted`` drafts passed."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_draft_steps += num_drafted > 0
        per_pos = self.accepted_per_pos
        if num_accepted > len(per_pos):
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def add(self, step: SpeculativeStats) -> None:
        """Fold one step's counters into this sum."""
        self.num_steps += step.num_steps
        self.k = step.k
        self.num_drafted += step.num_drafted
        self.num_accepted += step.num_accepted
        self.num_draft_steps += step.num_draft_steps
        per_pos = self.accepted_per_pos
        if len(step.accepted_per_pos) > len(per_pos):
            per_pos.extend([0] * (len(step.accepted_per_pos) - len(per_pos)))
        for pos, n in enumerate(step.accepted_per_pos):
            per_pos[pos] += n
        self.num_emitted += step.num_emitted
        self.draft_time_s += step.draft_time_s
        self.verify_time_s += step.verify_time_s
