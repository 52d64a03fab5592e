"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858 §4.1): which nodes to expand at
each depth, the tree attention mask of the head pass that expands them, and the nodes kept.

A node's score is the sum of log q along its path (the log of the product of q); each depth
expands the ``width`` best-scoring nodes of the depth before by their ``width`` likeliest children,
and the ``nodes`` best-scoring nodes overall form the tree. A child is never likelier than its
parent, so the kept set is ancestor-closed. The head passes themselves run in
:meth:`~specroll.drafter.eagle.EagleProposer.propose_tree`; this module holds no model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specroll.engine.spec.tree import DraftTree


@dataclass(eq=False)
class TreeLevel:
    """The inputs of the head pass that expands one depth: a head row per frontier node.

    Rows are grouped by batch row (``live``, in order), ``q_lens[j]`` of them for ``live[j]``.
    """

    live: list[int]
    """Batch rows with nodes to expand."""
    draft_ids: list[int]
    """Draft-vocabulary id of each node (the token the head embeds)."""
    features: list[torch.Tensor]
    """The head's output at each node's parent, ``[H]`` each (its feature input)."""
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    masks: dict[int, torch.Tensor]
    """Tree attention masks by index into ``live``: bool ``[q_len, kv tree rows]``, each node sees
    its ancestors and itself."""


class TreeSearch:
    """The candidate nodes of a batch's trees, grown one depth at a time.

    Args:
        logq: float32 ``[R, draft_vocab]`` processed log q at each row's first draft position.
        last: ``[R, H]`` the head's output there (the features of the depth-1 nodes' parent).
        num_computed: each row's head K/V positions computed from target features.
        width: nodes expanded per depth, and children per expanded node.
        depth: most drafts on one path.
    """

    def __init__(self, logq: torch.Tensor, last: torch.Tensor, num_computed: list[int], width: int,
                 depth: int) -> None:
        self.width, self.depth, self.num_computed = width, depth, num_computed
        # candidates per row: (score, depth, parent candidate index or -1, draft id, log q)
        top_q, top_id = logq.topk(min(width, logq.shape[-1]), dim=-1)  # [R, W]
        self.cands: list[list[tuple[float, int, int, int, float]]] = [
            [(s_, 1, -1, t, s_) for s_, t in zip(qs, ts, strict=True) if s_ > float("-inf")]
            for qs, ts in zip(top_q.tolist(), top_id.tolist(), strict=True)
        ]
        self.frontier = [list(range(len(c))) for c in self.cands]  # candidate indices expanded next
        self.rows_of: list[dict[int, int]] = [{} for _ in num_computed]  # expanded candidate → its tree row
        self.hidden_of: list[dict[int, torch.Tensor]] = [{-1: last[r]} for r in range(len(num_computed))]

    def level(self, d: int) -> TreeLevel | None:
        """The head pass that expands depth ``d``'s frontier (at position ``num_computed + d - 1``),
        or None when no row has a node left to expand."""
        live = [r for r in range(len(self.frontier)) if self.frontier[r]]
        if not live:
            return None
        level = TreeLevel(live, [], [], [], [], [], {})
        for j, r in enumerate(live):
            cands, rows_of = self.cands[r], self.rows_of[r]
            base = len(rows_of)  # tree rows already appended for this row
            for i, c in enumerate(self.frontier[r]):
                _, _, parent, token, _ = cands[c]
                level.draft_ids.append(token)
                level.features.append(self.hidden_of[r][parent])
                rows_of[c] = base + i
            n = len(self.frontier[r])
            total = base + n
            mask = torch.zeros(n, total, dtype=torch.bool)  # [n, total]
            for i, c in enumerate(self.frontier[r]):
                a = c
                while a >= 0:
                    mask[i, rows_of[a]] = True
                    a = cands[a][2]
            level.masks[j] = mask
            level.positions.extend([self.num_computed[r] + d - 1] * n)
            level.q_lens.append(n)
            level.kv_lens.append(self.num_computed[r] + total)
        return level

    def expand(self, level: TreeLevel, d: int, out: torch.Tensor, logq: torch.Tensor) -> None:
        """Give each node of ``level`` its ``width`` likeliest children, and choose the next frontier.

        Args:
            out: ``[N, H]`` the head's output at each node of the level.
            logq: float32 ``[N, draft_vocab]`` processed log q there.
        """
        top_q, top_id = logq.topk(min(self.width, logq.shape[-1]), dim=-1)  # [N, W]
        i = 0
        for r in level.live:
            cands, new = self.cands[r], []
            for c in self.frontier[r]:
                self.hidden_of[r][c] = out[i]
                parent_score = cands[c][0]
                for s_, t in zip(top_q[i].tolist(), top_id[i].tolist(), strict=True):
                    if s_ > float("-inf"):
                        new.append(len(cands))
                        cands.append((parent_score + s_, d + 1, c, t, s_))
                i += 1
            new.sort(key=lambda c: -cands[c][0])
            self.frontier[r] = new[: self.width] if d + 1 < self.depth else []

    def tree(self, r: int, d2t: list[int], nodes: int) -> DraftTree:
        """Row ``r``'s ``nodes`` best-scoring candidates as a tree of target ids (``d2t``: draft id →
        target id), parents before children."""
        cands = self.cands[r]
        order = sorted(range(len(cands)), key=lambda c: (-cands[c][0], cands[c][1], c))[:nodes]
        index: dict[int, int] = {}
        keep = []
        for c in sorted(order, key=lambda c: (cands[c][1], -cands[c][0], c)):  # by depth: parents first
            if cands[c][2] < 0 or cands[c][2] in index:
                index[c] = len(keep)
                keep.append(c)
        return DraftTree([d2t[cands[c][3]] for c in keep],
                         [index.get(cands[c][2], -1) for c in keep],
                         [math.exp(cands[c][4]) for c in keep])
