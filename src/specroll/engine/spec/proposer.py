"""The proposer interface: what a drafter (``specroll.drafter``) gives the engine's verifier.

A proposer drafts up to k tokens per sequence. Model-free proposers (n-gram/suffix matching) give
no probabilities, which the verifier treats as one-hot q; a learned drafter that samples its drafts
passes the distributions q it sampled from (see ``engine/spec/verify.py``).

A learned drafter reads the target's hidden features (EAGLE): it names the layers to tap in
``feature_layers`` and the engine hands it, after every step, the features of each position whose
target K/V became valid (:class:`FeatureUpdate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specroll.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from specroll.engine.model import CausalLM
    from specroll.engine.spec.tree import DraftTree, TreeShape


def draft_cap(max_len: int, num_tokens: int, k: int) -> int:
    """The most drafts a sequence with ``num_tokens`` tokens and length limit ``max_len`` may verify
    in a step whose draft length is ``k``: ``min(k, max_len − num_tokens − 1)``, and never below 0.

    A step emits the accepted drafts + 1 token, so with n tokens and limit L at most L − n − 1
    drafts keep the sequence within L, and the verify rows ``[last, d_1..d_cap]`` sit at
    positions below L (the engine's ``max_len`` is at most the context length). The one rule for
    the engine's trimming of a proposal, the scheduler's K/V reservation for drafts and any count
    of verified drafts outside the engine.
    """
    return max(0, min(k, max_len - num_tokens - 1))


@dataclass(frozen=True)
class DraftInput:
    """One sequence to draft for."""

    request_id: str
    group_id: str | None
    """The group (n samples of one prompt); also identifies the prompt across RL steps."""
    token_ids: Sequence[int]
    """Prompt + response so far."""
    sampling: SamplingParams
    """The request's sampling; a sampling drafter draws from q processed the same way."""
    max_len: int | None = None
    """The most prompt + response tokens the request may reach (its ``max_tokens``, capped by the
    context): with :func:`draft_cap`, how many drafts the engine verifies. ``None``: not given."""


@dataclass(frozen=True)
class Proposal:
    token_ids: torch.Tensor
    """int64 ``[B, k]``; row b's drafts are the first ``num_drafts[b]``, the rest is padding (0)."""
    num_drafts: torch.Tensor
    """int64 ``[B]`` in ``[0, k]``: a proposer may draft fewer tokens, or none."""
    probs: torch.Tensor | None
    """float32 ``[B, k, V]`` draft distributions q over the target vocabulary, or ``None`` for
    one-hot q. A row drafted deterministically (greedy) may hold the one-hot vector of its draft."""


@dataclass(frozen=True)
class FeatureUpdate:
    """Target features of positions ``[start, start + n)`` of one request, now in the target's K/V."""

    request_id: str
    group_id: str | None
    start: int
    """First position; below the proposer's own count only after a preemption (recompute)."""
    features: torch.Tensor
    """``[n, len(feature_layers) * hidden_size]`` in the engine's dtype, taps concatenated in order."""
    token_ids: Sequence[int]
    """The request's tokens so far (prompt + response); covers position ``start + n``."""
    prompt_len: int


def drafts_trees(proposer: object) -> bool:
    """Whether ``proposer`` also drafts trees: it has a ``propose_tree(batch, shape)`` method
    returning one :class:`~specroll.engine.spec.tree.DraftTree` per sequence (see :class:`TreeProposer`)."""
    return callable(getattr(proposer, "propose_tree", None))


class Proposer(Protocol):
    """Drafts tokens for a batch of sequences."""

    feature_layers: tuple[int, ...]
    """Target layers whose features :meth:`observe` receives (see ``CausalLM.forward``); ``()`` for none."""

    def attach(self, target: CausalLM) -> None:
        """(Re)bind to the target model: called when the engine starts and after each weight update."""
        ...

    def propose(self, batch: Sequence[DraftInput], k: int) -> Proposal:
        """Draft up to ``k`` tokens for each sequence in ``batch``."""
        ...

    def observe(self, updates: Sequence[FeatureUpdate]) -> None:
        """Target features of newly verified positions (called only when ``feature_layers``)."""
        ...

    def finish(self, request_id: str) -> None:
        """The request finished or was aborted: drop its state (or keep it as history)."""
        ...


class TreeProposer(Proposer, Protocol):
    """A proposer that also drafts trees (``spec/tree.py``)."""

    def propose_tree(self, batch: Sequence[DraftInput], shape: TreeShape) -> list[DraftTree]:
        """A draft tree within ``shape`` for each sequence in ``batch`` (one with no nodes: none)."""
        ...
