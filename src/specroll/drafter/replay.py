"""A proposer that replays known continuations: the mechanism's upper bound, for benchmarks and tests.

Given earlier rollouts keyed by group (e.g. the greedy rollout of each prompt), it drafts the next
k tokens of the rollout whose tokens the sequence has followed so far, and nothing once it departs.
Replaying a greedy rollout into a greedy run makes every draft correct, so the speedup measured
with it is what verification alone allows (proposing costs almost nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specroll.engine.model import CausalLM
from specroll.engine.spec.proposer import DraftInput, FeatureUpdate, Proposal


class ReplayProposer:
    """Drafts from known rollouts (one-hot q).

    Args:
        rollouts: group id → a full token sequence (prompt + response) to replay.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, rollouts: Mapping[str, Sequence[int]]) -> None:
        self.rollouts = {group: list(tokens) for group, tokens in rollouts.items()}

    def attach(self, target: CausalLM) -> None:
        """Model-free: nothing to bind."""

    def observe(self, updates: Sequence[FeatureUpdate]) -> None:
        """Model-free: never called."""

    def finish(self, request_id: str) -> None:
        """Stateless per request."""

    def propose(self, batch: Sequence[DraftInput], k: int) -> Proposal:
        """The next ``k`` tokens of the sequence's group rollout while the sequence still follows it."""
        drafts = torch.zeros(len(batch), k, dtype=torch.long)
        num = torch.zeros(len(batch), dtype=torch.long)
        for b, seq in enumerate(batch):
            rollout = self.rollouts.get(seq.group_id) if seq.group_id is not None else None
            n = len(seq.token_ids)
            if rollout is None or rollout[:n] != list(seq.token_ids):
                continue
            found = rollout[n : n + k]
            drafts[b, : len(found)] = torch.tensor(found, dtype=torch.long)
            num[b] = len(found)
        return Proposal(drafts, num, None)
