"""Tree speculation: a tree of drafts per sequence, verified in one target forward, lossless.

A drafter proposes a small tree of tokens after each sequence's last token (several candidates
per position where it is unsure, EAGLE-2's dynamic tree: Li et al. 2024, "EAGLE-2", arXiv
2406.16858 §4). The target scores every node in one forward pass, each node attending to the
sequence's K/V and to its own ancestors only (tree attention: SpecInfer, Miao et al. 2024, §4.2),
at the position of its depth. Verification then walks the tree from the root.

**Verification.** At a node with target distribution p (temperature → top-k → top-p processed, as
plain sampling), draw ``y ~ p``; when a child of the node carries ``y`` the walk moves to it, else
``y`` is emitted and the walk stops (at a leaf, ``y`` is the bonus token). Every emitted token is a
draw from the target's distribution at its prefix, so the output is distributed exactly as plain
sampling — at any temperature, for any tree the drafter builds without looking at those draws.

This is recursive rejection sampling (SpecInfer Algorithm 2, "multi-step speculative sampling";
Chen et al. 2023 Algorithm 2 for one draft) for drafts whose draft distribution is a point mass,
as the children of a deterministic (top-k) tree are: with candidates ``c_1..c_m`` at a node, RRS
accepts ``c_1`` with probability ``min(1, p(c_1)/1) = p(c_1)`` and on rejection replaces p by the
residual ``norm(max(0, p − δ_{c_1}))`` = p without ``c_1``; ``c_2`` is then accepted with
``p(c_2) / (1 − p(c_1))``, and so on, and after every rejection a token is drawn from p without
``c_1..c_m``. Each candidate is thus taken with probability exactly ``p(c_i)``, and the token
drawn on rejection with ``p(y)`` — one inverse-CDF draw from p followed by a lookup among the
children realises the same distribution (and, with one uniform per emitted token from the
request's own generator, draws exactly what plain sampling would). Acceptance at a node is the
target mass on its children, ``Σ_i p(c_i)``, which is why several candidates pay at T = 1 where a
single draft is accepted only with ``1 − TV(p, q)``. Greedy requests follow the argmax path.

**Sampled trees.** A drafter may instead draw a node's children from its own distribution q
(processed like the request's), ``c_1, c_2, ..`` in order *without replacement* (``c_i`` from q
with ``c_1..c_{i-1}`` removed and renormalised), and hand q over with the tree
(``DraftTree.q``). Such a node is verified by recursive rejection sampling over q (SpecInfer,
Miao et al. 2024, Algorithm 2 "multi-step speculative sampling", in the without-replacement form
of Jeon et al. 2024, "Recursive Speculative Decoding", arXiv 2402.14160 §3): with ``p_1 = p`` and
``q_1 = q``, child ``c_i`` is accepted when ``u_i · q_i(c_i) < p_i(c_i)`` (probability
``min(1, p_i/q_i)``); on rejection ``p_{i+1} = norm(max(0, p_i − q_i))`` and ``q_{i+1} = q_i``
without ``c_i``, renormalised; after the last child the token is drawn from ``p_{m+1}``. Each
step's output is ``min(p_i, q_i) + max(0, p_i − q_i) = p_i`` in distribution, so the node emits a
draw from p exactly — provided how many children a node has is fixed before they are drawn (a
drafter that kept or dropped a child by its value would bias it). Acceptance at such a node is at
least ``1 − TV(p, q)``, and 1 when q = p, where a top-k node covers only ``Σ_i p(c_i)``.
Greedy requests and nodes without a usable q row are walked as above (which is lossless for any
children at all, only less often accepted for sampled ones).

Behavior logprobs are the target's processed logprobs of each emitted token, as everywhere.

After verification only the accepted path's K/V stays: the path's nodes are moved to the slots
right after the root (their positions), and the other nodes' slots are rolled back.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from specroll.engine.sampler import draw_inverse_cdf, processed_logprobs
from specroll.engine.sequence import Sequence


@dataclass(frozen=True, order=True)
class TreeShape:
    """How large a draft tree may grow (EAGLE-2's dynamic-tree parameters).

    The drafter expands the ``width`` most likely nodes of each depth by their ``width`` most
    likely children, to ``depth`` levels, and keeps the ``nodes`` most likely nodes overall (by the
    product of draft probabilities along their path).
    """

    depth: int
    """Most drafts on one path (the most tokens a step can accept)."""
    width: int
    """Nodes expanded per depth, and children per expanded node."""
    nodes: int
    """Most nodes in the tree (the K/V slots and target rows it costs per sequence)."""
    sampled: bool = False
    """Children drawn from the drafter's q without replacement and verified by recursive rejection
    sampling (module docstring), for sampling requests; False: the ``width`` likeliest children."""

    def __post_init__(self) -> None:
        for name in ("depth", "width", "nodes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"tree shape {name}={value!r}, expected a positive integer")
        if type(self.sampled) is not bool:
            raise ValueError(f"tree shape sampled={self.sampled!r}, expected true or false")
        if self.nodes > MAX_TREE_NODES:
            raise ValueError(f"tree shape nodes={self.nodes}, expected at most {MAX_TREE_NODES}")
        if self.depth > self.nodes:
            raise ValueError(f"tree shape depth={self.depth} exceeds nodes={self.nodes}: a path of "
                             f"{self.depth} drafts needs {self.depth} nodes")
        reachable = self.width + (self.depth - 1) * self.width**2
        if self.nodes > reachable:
            raise ValueError(f"tree shape nodes={self.nodes} exceeds the {reachable} nodes depth={self.depth}, "
                             f"width={self.width} can grow (width + (depth - 1) * width²)")

    def __str__(self) -> str:
        sampled = ", sampled" if self.sampled else ""
        return f"tree(depth={self.depth}, width={self.width}, nodes={self.nodes}{sampled})"

    @property
    def text(self) -> str:
        """The shape as :meth:`parse` reads it, e.g. ``"5x4:16"`` or ``"5x4:16:sampled"``."""
        return f"{self.depth}x{self.width}:{self.nodes}" + (":sampled" if self.sampled else "")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """``"DEPTHxWIDTH:NODES"`` (top-k children), e.g. ``"5x4:16"``, or ``"DEPTHxWIDTH:NODES:sampled"``
        (children sampled from q).

        Raises:
            ValueError: the text is not in that form or a number is out of range.
        """
        try:
            dims, nodes, *kind = text.split(":")
            if kind not in ([], ["sampled"]):
                raise ValueError
            numbers = [*dims.lower().split("x"), nodes]
            if len(numbers) != 3 or not all(n.isascii() and n.isdigit() for n in numbers):
                raise ValueError  # int() would also take "1_2", " 3" or "+3"
            depth, width, count = map(int, numbers)
            return cls(depth, width, count, sampled=bool(kind))
        except ValueError as exc:
            if "tree shape" in str(exc):
                raise
            raise ValueError(f"tree shape {text!r}: expected DEPTHxWIDTH:NODES or DEPTHxWIDTH:NODES:sampled, "
                             "e.g. '5x4:16'") from None


MAX_TREE_NODES = 64
"""Largest node budget: a verify row per node and sequence, and a mask of nodes² per sequence."""


@dataclass(frozen=True)
class DraftTree:
    """One sequence's drafts as a tree hanging off its last token (the root, not a node).

    Nodes are in topological order: a node's parent comes before it.
    """

    tokens: list[int]
    """Token of each node."""
    parents: list[int]
    """Parent node index of each node; -1 for children of the root."""
    draft_probs: list[float] | None = None
    """The drafter's probability of each node's token at its parent (diagnostics and tests; the
    verification never reads it)."""
    q_support: torch.Tensor | None = None
    """Sampled trees: int64 ``[S]`` ascending target ids, the support of every row of :attr:`q`."""
    q: dict[int, torch.Tensor] | None = None
    """Sampled trees: by parent (a node index, -1 for the root), float ``[S]`` the distribution over
    :attr:`q_support` its children were drawn from, in node order and without replacement (module
    docstring); a parent without a row has its children walked as top-k children."""

    def __len__(self) -> int:
        return len(self.tokens)

    def _with_nodes(self, keep: list[int]) -> DraftTree:
        """The tree of nodes ``keep`` (ascending, ancestor-closed), re-indexed, with their q rows."""
        new_index = {old: new for new, old in enumerate(keep)}
        probs = None if self.draft_probs is None else [self.draft_probs[i] for i in keep]
        q = None
        if self.q is not None:
            q = {(-1 if p < 0 else new_index[p]): row for p, row in self.q.items() if p < 0 or p in new_index}
        return DraftTree([self.tokens[i] for i in keep], [new_index.get(self.parents[i], -1) for i in keep], probs,
                         self.q_support, q)

    def depths(self) -> list[int]:
        """Depth of each node (children of the root: 1)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes (an ancestor-closed tree: parents come first)."""
        return self._with_nodes(list(range(min(n, len(self.tokens)))))

    def ancestor_mask(self) -> torch.Tensor:
        """bool ``[N+1, N+1]`` over (root, nodes): row i sees column j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[0, 0] = True
        for i, parent in enumerate(self.parents, start=1):
            if parent >= 0:
                mask[i] = mask[parent + 1]
            mask[i, i] = True
        return mask


def valid_tree(tree: DraftTree, shape: TreeShape, vocab_size: int) -> DraftTree:
    """The longest prefix of ``tree`` verification can trust: nodes up to the first one with a token
    outside the vocabulary, a parent that is not an earlier node, a depth past ``shape.depth``, a
    token its earlier sibling already has, or past ``shape.nodes`` nodes. (A proposer is pluggable
    code; any tree is lossless to verify, a malformed one is just cut.)"""
    n = min(len(tree.tokens), len(tree.parents), shape.nodes)
    depths: list[int] = []
    seen: set[tuple[int, int]] = set()
    for i in range(n):
        token, parent = tree.tokens[i], tree.parents[i]
        if not (0 <= token < vocab_size and -1 <= parent < i) or (parent, token) in seen:
            return tree.prefix(i)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if depths[-1] > shape.depth:
            return tree.prefix(i)
        seen.add((parent, token))
    return tree.prefix(n)


def cap_tree(tree: DraftTree, max_depth: int, max_nodes: int) -> DraftTree:
    """The nodes of ``tree`` at depth ≤ ``max_depth``, at most ``max_nodes`` of them (in order)."""
    keep, depths = [], tree.depths()
    for i, d in enumerate(depths):
        if len(keep) == max_nodes:
            break
        if d <= max_depth and (tree.parents[i] < 0 or tree.parents[i] in keep):
            keep.append(i)
    if len(keep) == len(tree.tokens):
        return tree
    return tree._with_nodes(keep)


@dataclass(frozen=True)
class TreeVerdict:
    """One sequence's verification."""

    token_ids: list[int]
    """Emitted tokens: the accepted path's tokens, then the token drawn where the walk stopped."""
    logprobs: list[float]
    """Their behavior logprobs (the target's processed distribution)."""
    path: list[int]
    """The accepted nodes, root's child first (``len(path)`` drafts accepted)."""


def verify_trees(
    logits: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    seqs: SequenceOf[Sequence],
    trees: SequenceOf[DraftTree],
    num_rows: int | None = None,
) -> list[TreeVerdict]:
    """Walk each sequence's tree with draws from the target (module docstring), all sequences at once.

    Args:
        logits: float32 ``[sum(len(tree) + 1), V]``: per sequence in order, the target's logits at
            its last token (the root) and at each node, in node order; or a function giving the
            logits ``[n, V]`` of rows int64 ``[n]`` of that layout, called once per depth the walk
            reaches with the rows the walk stands on (the LM head then runs on the accepted path
            and one row more per sequence, not on every node: on a CPU it is most of a tree's cost).
        num_rows: the rows of that layout when ``logits`` is a function.
        seqs: the sequences (their sampling parameters and generators).
        trees: each sequence's tree (may have no nodes: plain sampling).

    Returns:
        A :class:`TreeVerdict` per sequence. Each sampled sequence draws from its own generator one
        uniform per emitted token at a top-k node (as plain sampling), and at a node with a usable
        q row one per child tested plus one when all are rejected; greedy ones draw none.

    Raises:
        ValueError: ``logits`` does not have one row per root and node.
    """
    starts, row = [], 0
    for tree in trees:
        starts.append(row)
        row += len(tree) + 1
    if callable(logits):
        logits_of, have = logits, num_rows
    else:
        table = logits
        logits_of, have = (lambda rows: table.index_select(0, rows.to(table.device))), table.shape[0]
    if have != row or len(seqs) != len(trees):
        raise ValueError(f"logits has {have} rows for {len(trees)} trees of {row} rows and {len(seqs)} sequences")
    children = [{(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True))} for tree in trees]
    supports: list[torch.Tensor | None] | None = None
    node = [-1] * len(trees)
    verdicts = [TreeVerdict([], [], []) for _ in trees]
    active = list(range(len(trees)))
    while active:
        rows = torch.tensor([starts[b] + node[b] + 1 for b in active])
        params = [seqs[b].sampling for b in active]
        logprobs = processed_logprobs(logits_of(rows), params).cpu()  # [A, V]
        tokens = logprobs.argmax(-1)
        if supports is None:
            supports = [usable_support(tree, logprobs.shape[-1]) for tree in trees]
        # sampling rows standing on a node whose children were drawn from a usable q: recursive rejection
        rrs = {i: q_row for i, b in enumerate(active) if not params[i].greedy
               and (q_row := node_q(trees[b], supports[b], node[b])) is not None}
        walked = [i for i, p in enumerate(params) if not p.greedy and i not in rrs]
        if walked:  # exp in float32, the CDF in float64: as plain sampling draws
            u = torch.cat([torch.rand(1, dtype=torch.float64, generator=seqs[active[i]].generator) for i in walked])
            tokens[walked] = draw_inverse_cdf(logprobs[walked].exp().double(), u)
        accepted: dict[int, int | None] = {}
        for i, q_row in rrs.items():
            b = active[i]
            kids = [c for c in range(len(trees[b])) if trees[b].parents[c] == node[b]]
            accepted[i], tokens[i] = rejection_walk(logprobs[i].exp().double(), supports[b], q_row, kids,
                                                    trees[b].tokens, seqs[b].generator)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        still = []
        for i, (b, token, logprob) in enumerate(zip(active, tokens.tolist(), chosen, strict=True)):
            verdict = verdicts[b]
            verdict.token_ids.append(token)
            verdict.logprobs.append(logprob)
            child = accepted[i] if i in accepted else children[b].get((node[b], token))
            if child is not None:
                verdict.path.append(child)
                node[b] = child
                still.append(b)
        active = still
    return verdicts


def usable_support(tree: DraftTree, vocab_size: int) -> torch.Tensor | None:
    """``tree.q_support`` when verification can trust it (int64 ascending ids in ``[0, vocab_size)``), else None."""
    support = tree.q_support
    if tree.q is None or support is None or support.dim() != 1 or support.dtype != torch.long or not len(support):
        return None
    support = support.cpu()
    if int(support[0]) < 0 or int(support[-1]) >= vocab_size or not bool((support[1:] > support[:-1]).all()):
        return None
    return support


def node_q(tree: DraftTree, support: torch.Tensor | None, node: int) -> torch.Tensor | None:
    """float64 ``[S]`` the q node ``node``'s children were drawn from, when verification can trust it:
    a distribution over ``support`` (finite, non-negative, summing to 1) giving each child's token
    positive mass. None: walk the node as top-k children (lossless for any children)."""
    if support is None or tree.q is None or (row := tree.q.get(node)) is None or row.shape != support.shape:
        return None
    q = row.detach().double().cpu()
    if not (bool(torch.isfinite(q).all()) and bool((q >= 0).all()) and abs(float(q.sum()) - 1) < 1e-3):
        return None
    kids = torch.tensor([t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == node], dtype=torch.long)
    if not len(kids):
        return None  # a leaf: its one draw is plain sampling either way
    at = torch.searchsorted(support, kids).clamp(max=len(support) - 1)
    if not (bool((support[at] == kids).all()) and bool((q[at] > 0).all())):
        return None
    return q / q.sum()


def rejection_walk(p: torch.Tensor, support: torch.Tensor, q: torch.Tensor, kids: list[int], tokens: list[int],
                   generator: torch.Generator | None) -> tuple[int | None, int]:
    """Recursive rejection sampling without replacement at one node (module docstring; Jeon et al.
    2024, arXiv 2402.14160, Algorithm 1).

    Args:
        p: float64 ``[V]`` the target's processed distribution at the node.
        support, q: int64 ``[S]`` ascending ids and float64 ``[S]`` the draft distribution there.
        kids: the node's children (node indices), in the order they were drawn; ``tokens``: every node's token.
        generator: the request's generator: one uniform per child tested, one more when all are rejected.

    Returns:
        ``(accepted child or None, emitted token)``.
    """
    p, q = p.clone(), q.clone()
    for c in kids:
        token = tokens[c]
        j = int(torch.searchsorted(support, torch.tensor(token)))
        u = float(torch.rand(1, dtype=torch.float64, generator=generator))
        if u * float(q[j]) < float(p[token]):
            return c, token
        residual = (p[support] - q).clamp_(min=0)  # max(0, p − q) on q's support; p elsewhere
        rest = p.clone()
        rest[support] = residual
        if float(rest.sum()) > 0:  # p ≤ q everywhere: rejection had probability 0, keep p
            p = rest / rest.sum()
        q[j] = 0.0
        if float(q.sum()) > 0:
            q = q / q.sum()
    u = torch.rand(1, dtype=torch.float64, generator=generator)
    return None, int(draw_inverse_cdf(p[None], u)[0])
