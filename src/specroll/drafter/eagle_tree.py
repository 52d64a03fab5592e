"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858 §4.1): which nodes to expand at
each depth, the tree attention mask of the head pass that expands them, and the nodes kept.

A node's score is the sum of log q along its path (the log of the product of q); each depth
expands the ``width`` best-scoring nodes of the depth before by their ``width`` likeliest children,
and the ``nodes`` best-scoring nodes overall form the tree. A child is never likelier than its
parent, so the kept set is ancestor-closed.

A *sampled* row (``TreeShape.sampled``, a sampling request) draws each expanded node's children
from q instead, without replacement, and keeps q for the verifier's recursive rejection sampling
(``engine/spec/tree.py``). There, how many children a node gets must not depend on the children
drawn, so the node budget is spent as the tree grows: each depth's frontier (still the ``width``
best-scoring nodes) takes ``min(width, budget left)`` children per node in score order, and the
tree keeps every node drawn, ordered by depth, then parent, then draw order, so that any prefix
of it (the engine's caps) keeps a prefix of each node's draws. The head passes themselves run in
:meth:`~specroll.drafter.eagle.EagleProposer.propose_tree`; this module holds no model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specroll.engine.sampler import draw_inverse_cdf
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
        samplers: per row, the generator its children are drawn with (a sampled row), or None (the
            ``width`` likeliest children); all None when not given.
        nodes: the node budget of sampled rows.
    """

    def __init__(self, logq: torch.Tensor, last: torch.Tensor, num_computed: list[int], width: int,
                 depth: int, samplers: list[torch.Generator | None] | None = None, nodes: int = 0) -> None:
        self.width, self.depth, self.num_computed = width, depth, num_computed
        self.samplers = samplers if samplers is not None else [None] * len(num_computed)
        self.budget = [nodes] * len(num_computed)
        self.q_of: list[dict[int, torch.Tensor]] = [{} for _ in num_computed]
        """Sampled rows: float32 ``[draft_vocab]`` q at each expanded candidate (-1: the root)."""
        # candidates per row: (score, depth, parent candidate index or -1, draft id, log q)
        top_q, top_id = logq.topk(min(width, logq.shape[-1]), dim=-1)  # [R, W]
        self.cands: list[list[tuple[float, int, int, int, float]]] = [
            [(s_, 1, -1, t, s_) for s_, t in zip(qs, ts, strict=True) if s_ > float("-inf")]
            if self.samplers[r] is None else self._draw(r, -1, 0.0, 1, logq[r])
            for r, (qs, ts) in enumerate(zip(top_q.tolist(), top_id.tolist(), strict=True))
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
            for c in self.frontier[r]:  # in score order: a sampled row's budget goes to the likeliest first
                self.hidden_of[r][c] = out[i]
                parent_score = cands[c][0]
                if self.samplers[r] is not None:
                    drawn = self._draw(r, c, parent_score, d + 1, logq[i])
                    new.extend(range(len(cands), len(cands) + len(drawn)))
                    cands.extend(drawn)
                    i += 1
                    continue
                for s_, t in zip(top_q[i].tolist(), top_id[i].tolist(), strict=True):
                    if s_ > float("-inf"):
                        new.append(len(cands))
                        cands.append((parent_score + s_, d + 1, c, t, s_))
                i += 1
            new.sort(key=lambda c: -cands[c][0])
            width = self.width if self.samplers[r] is None else min(self.width, -(-self.budget[r] // self.width))
            self.frontier[r] = new[:width] if d + 1 < self.depth else []  # a sampled row: as many as its budget feeds

    def _draw(self, r: int, parent: int, parent_score: float, depth: int,
              logq: torch.Tensor) -> list[tuple[float, int, int, int, float]]:
        """Sampled row ``r``: ``min(width, budget left, tokens q allows)`` children of candidate
        ``parent`` drawn from ``exp(logq)`` without replacement (one inverse-CDF draw each, the drawn
        token removed before the next), as candidates; q is kept for the verifier."""
        q = logq.double().exp()  # [draft_vocab]
        m = min(self.width, self.budget[r], int((q > 0).sum()))
        self.budget[r] -= m
        if m == 0:
            return []
        self.q_of[r][parent] = q.float()
        out, rest = [], q.clone()
        for _ in range(m):
            u = torch.rand(1, dtype=torch.float64, generator=self.samplers[r])
            t = int(draw_inverse_cdf(rest[None], u)[0])
            rest[t] = 0.0
            lq = float(logq[t])
            out.append((parent_score + lq, depth, parent, t, lq))
        return out

    def tree(self, r: int, d2t: list[int], nodes: int, support: torch.Tensor | None = None) -> DraftTree:
        """Row ``r``'s ``nodes`` best-scoring candidates as a tree of target ids (``d2t``: draft id →
        target id), parents before children; a sampled row's every candidate, by depth, parent and
        draw order, with its q rows over ``support`` (int64 ascending target ids of the draft vocabulary)."""
        cands = self.cands[r]
        if self.samplers[r] is not None:
            keep = sorted(range(len(cands)), key=lambda c: (cands[c][1], c))  # appended by parent, in draw order
            index = {c: i for i, c in enumerate(keep)}
            q = {(-1 if c < 0 else index[c]): row for c, row in self.q_of[r].items() if c < 0 or c in index}
            return DraftTree([d2t[cands[c][3]] for c in keep], [index.get(cands[c][2], -1) for c in keep],
                             [math.exp(cands[c][4]) for c in keep], support, q)
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
