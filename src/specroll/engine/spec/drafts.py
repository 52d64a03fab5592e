"""Drafting inside an engine step: the proposer's drafts for the sequences that decode, trimmed to
what verification can trust and to each request's length limit, and the target features of the
positions a step made valid, handed back to the proposer.
"""

from __future__ import annotations

import torch

from specroll.engine.scheduler import ScheduledSequence
from specroll.engine.sequence import Sequence, SequenceStatus
from specroll.engine.spec.proposer import DraftInput, FeatureUpdate, Proposal, Proposer, draft_cap
from specroll.engine.spec.tree import DraftTree, TreeShape, cap_tree, valid_tree


def propose_drafts(
    proposer: Proposer, scheduled: list[ScheduledSequence], k: int, vocab_size: int, page_size: int
) -> tuple[dict[Sequence, list[int]], dict[Sequence, torch.Tensor]]:
    """Drafts (and their q, when sampled) for the sequences that decode this step, capped by
    :func:`~specroll.engine.spec.proposer.draft_cap` so a request never passes its length limit,
    and by the K/V slots its pages hold past the step's token (a request admitted this step with all
    but its last prompt token from the prefix cache has pages for that token only)."""
    decoding = [s.seq for s in scheduled if s.samples and s.num_new_tokens == 1]
    if not decoding:
        return {}, {}
    proposal = proposer.propose(
        [DraftInput(seq.request_id, seq.group_id, seq.token_ids, seq.sampling, seq.max_len) for seq in decoding],
        k
    )
    valid = valid_drafts(proposal, len(decoding), k, vocab_size)  # [B] usable drafts per row
    drafts, probs = {}, {}
    for b, (seq, row, n) in enumerate(
        zip(decoding, proposal.token_ids.tolist(), valid.tolist(), strict=True)
    ):
        room = len(seq.block_table) * page_size - seq.num_computed_tokens - 1
        n = min(n, draft_cap(seq.max_len, seq.num_tokens, k), room)
        if n > 0:
            drafts[seq] = row[:n]
            if proposal.probs is not None:
                probs[seq] = proposal.probs[b, :n]
    return drafts, probs


def propose_trees(
    proposer: Proposer,
    scheduled: list[ScheduledSequence],
    shape: TreeShape,
    vocab_size: int,
    page_size: int,
    max_model_len: int,
) -> dict[Sequence, DraftTree]:
    """Draft trees for the sequences that decode this step, trimmed to what verification can trust
    (:func:`~specroll.engine.spec.tree.valid_tree`), to nodes at depth ≤
    :func:`~specroll.engine.spec.proposer.draft_cap` (a request never passes its length limit) and
    to the K/V slots past the step's token (one per node) that its pages hold and the context
    (``max_model_len`` slots) has: a tree's nodes take a slot each though their positions only
    go as deep as the tree."""
    decoding = [s.seq for s in scheduled if s.samples and s.num_new_tokens == 1]
    if not decoding:
        return {}
    trees = proposer.propose_tree(  # type: ignore[attr-defined]
        [DraftInput(seq.request_id, seq.group_id, seq.token_ids, seq.sampling, seq.max_len) for seq in decoding],
        shape,
    )
    if len(trees) != len(decoding):
        raise ValueError(f"the proposer drafted {len(trees)} trees for {len(decoding)} sequences")
    out = {}
    for seq, tree in zip(decoding, trees, strict=True):
        room = min(len(seq.block_table) * page_size, max_model_len) - seq.num_computed_tokens - 1
        tree = cap_tree(valid_tree(tree, shape, vocab_size), draft_cap(seq.max_len, seq.num_tokens, shape.depth),
                        room)
        if len(tree):
            out[seq] = tree
    return out


def valid_drafts(proposal: Proposal, batch: int, k: int, vocab_size: int) -> torch.Tensor:
    """int64 ``[B]``: how many leading drafts of each row verification can trust. A proposer is
    pluggable code: drafts after an out-of-vocabulary id, or after a q row that is not a
    distribution (NaN or infinite, negative, not summing to 1, or 0 at its own draft), are
    dropped — verifying against a broken q would no longer be lossless.

    Raises:
        ValueError: the proposal's tensors have the wrong shapes.
    """
    ids, num = proposal.token_ids, proposal.num_drafts
    if tuple(ids.shape) != (batch, k) or tuple(num.shape) != (batch,):
        raise ValueError(f"proposal token_ids {tuple(ids.shape)}, num_drafts {tuple(num.shape)}: "
                         f"expected ({batch}, {k}) and ({batch},)")
    ok = (ids >= 0) & (ids < vocab_size)  # [B, k]
    if proposal.probs is not None:
        q = proposal.probs.double()
        if tuple(q.shape) != (batch, k, vocab_size):
            raise ValueError(f"proposal probs {tuple(q.shape)}: expected ({batch}, {k}, {vocab_size})")
        q_draft = q.gather(-1, ids.clamp(0, vocab_size - 1)[..., None]).squeeze(-1)
        ok &= torch.isfinite(q).all(-1) & (q >= 0).all(-1) & ((q.sum(-1) - 1).abs() < 1e-3) & (q_draft > 0)
    leading = ok.long().cumprod(-1).sum(-1)  # drafts before the first bad one
    return torch.minimum(num.clamp(0, k), leading)


def observe_features(
    proposer: Proposer,
    scheduled: list[ScheduledSequence],
    drafts: dict[Sequence, list[int]],
    starts: list[int],
    features: torch.Tensor,
    paths: dict[Sequence, list[int]] | None = None,
) -> None:
    """Hand the proposer the features of each live sequence's newly valid positions: its input
    rows of this step up to the last accepted draft (of a tree: the rows of its accepted path).

    Args:
        starts: each scheduled sequence's computed tokens before the step.
        features: the target features of every input row of the step (drafts included).
        paths: the accepted nodes of the sequences that verified a draft tree.
    """
    updates = []
    row = 0
    for s, start in zip(scheduled, starts, strict=True):
        seq = s.seq
        if seq.status is not SequenceStatus.FINISHED:
            path = None if paths is None else paths.get(seq)
            if path is None:
                valid = seq.num_computed_tokens - start  # new tokens + accepted drafts
                rows = features[row : row + valid]
            else:
                rows = features[[row + i for i in range(s.num_new_tokens)] + [row + s.num_new_tokens + n for n in path]]
            updates.append(FeatureUpdate(seq.request_id, seq.group_id, start, rows, seq.token_ids, seq.prompt_len))
        row += s.num_new_tokens + len(drafts.get(seq, ()))
    if updates:
        proposer.observe(updates)
