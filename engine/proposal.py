"""The proposer interface: what a drafter (``specroll.drafter``) gives the engine's verifier.

A proposer drafts up to k tokens per sequence. Model-free proposers (n-gram/suffix matching) give
no probabilities, which the verifier treats as one-hot q; a learned drafter that samples its drafts
passes the distributions q it sampled from (see ``engine/rejection_sampler.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DraftInput:
    """One sequence to draft for."""

    request_id: str
    group_id: str | None
    """The group (n samples of one prompt); also identifies the prompt across RL steps."""
    token_ids: Sequence[int]
    """Prompt + response so far."""


@dataclass(frozen=True)
class Proposal:
    token_ids: torch.Tensor
    """int64 ``[B, k]``; row b's drafts are the first ``num_drafts[b]``, the rest is padding (0)."""
    num_drafts: torch.Tensor
    """int64 ``[B]`` in ``[0, k]``: a proposer may draft fewer tokens, or none."""
    probs: torch.Tensor | None
    """float ``[B, k, V]`` draft distributions q, or ``None`` for one-hot q."""


class Proposer(Protocol):
    """Drafts tokens for a batch of sequences."""

    def propose(self, batch: Sequence[DraftInput], k: int) -> Proposal:
        """Draft up to ``k`` tokens for each sequence in ``batch``."""
        ...

    def finish(self, request_id: str) -> None:
        """The request finished or was aborted: drop its state (or keep it as history)."""
        ...
