"""Sampled draft trees: children drawn from the drafter's q without replacement, verified by
recursive rejection sampling over q (``engine/spec/tree.py``). Chi-square tests on the emitted
tokens (α = 0.001), which a deliberately biased verifier (no residual update after a rejection)
fails; the EAGLE head's sampled trees are well formed and keep greedy output; a q row the
verifier cannot trust falls back to the lossless walk."""

from __future__ import annotations

import functools

import msgspec
import pytest
import torch
from helpers import engines
from helpers.checkpoints import teacher_forced_logits
from helpers.engines import StandIn
from helpers.trees import chi_square_p_value, eagle_engine, prompts, run

import specroll.engine.spec.tree as tree_module
from specroll.engine.driver import run_to_completion
from specroll.engine.sampler import draw_inverse_cdf, processed_logprobs
from specroll.engine.sequence import Sequence
from specroll.engine.spec.tree import DraftTree, TreeShape, cap_tree, verify_trees
from specroll.protocol.sampling import SamplingParams

make_engine = functools.partial(engines.make_engine, num_draft_tokens=4, draft_length="tree",
                                draft_trees=("2x2:4:sampled",))


def skewed_q(vocab: int, heavy: dict[int, float]) -> torch.Tensor:
    """float64 ``[vocab]``: the ``heavy`` masses, the rest spread evenly over every other token."""
    q = torch.full((vocab,), (1 - sum(heavy.values())) / (vocab - len(heavy)), dtype=torch.float64)
    for t, m in heavy.items():
        q[t] = m
    return q


def draw_without_replacement(q: torch.Tensor, m: int, g: torch.Generator) -> list[int]:
    rest, out = q.clone(), []
    for _ in range(m):
        t = int(draw_inverse_cdf(rest[None], torch.rand(1, dtype=torch.float64, generator=g))[0])
        rest[t] = 0.0
        out.append(t)
    return out


class SampledTree(StandIn):
    """Per request a fresh tree: two root children drawn from ``q0``, one child of each drawn from
    ``q1[child]``, all without replacement and handed over with their q rows (support: the vocabulary)."""

    def __init__(self, vocab: int, q0: torch.Tensor, q1: dict[int, torch.Tensor]) -> None:
        self.support = torch.arange(vocab)
        self.q0, self.q1, self.default = q0, q1, torch.full((vocab,), 1 / vocab, dtype=torch.float64)
        self.g = torch.Generator().manual_seed(7)

    def propose_tree(self, batch, shape):
        trees = []
        for seq in batch:
            if len(seq.token_ids) != 1:
                trees.append(DraftTree([], []))
                continue
            roots = draw_without_replacement(self.q0, 2, self.g)
            q = {-1: self.q0.float()}
            tokens, parents = list(roots), [-1, -1]
            for i, r in enumerate(roots):
                q1 = self.q1.get(r, self.default)
                tokens.append(draw_without_replacement(q1, 1, self.g)[0])
                parents.append(i)
                q[i] = q1.float()
            trees.append(DraftTree(tokens, parents, None, self.support, q))
        return trees


def biased_rejection_walk(p, support, q, kids, tokens, generator):
    """A broken verifier: each child accepted with min(1, p/q) against the *original* p and q (no
    residual, no renormalised q), the token drawn from p when all are rejected."""
    for c in kids:
        token = tokens[c]
        u = float(torch.rand(1, dtype=torch.float64, generator=generator))
        if u * float(q[token]) < float(p[token]):
            return c, token
    u = torch.rand(1, dtype=torch.float64, generator=generator)
    return None, int(draw_inverse_cdf(p[None], u)[0])


SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True),
    "t1_top_k": SamplingParams(temperature=1.0, top_k=6, max_tokens=2, ignore_eos=True),
}
NUM_SAMPLES = 1500


@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("biased", [False, True], ids=["verifier", "biased_verifier"])
def test_chi_square_of_sampled_tree_verification(chi_square_model, monkeypatch, name, biased):
    """Bins of the two emitted tokens: (a, a1), (a, ·), (b, b1), (b, ·), (c, ·), anything else, for
    the target's three likeliest first tokens a, b, c and likeliest seconds a1, b1; exact
    probabilities from the target's teacher-forced distributions. q favours c and b over a (unlike
    p), so rejections are common and their residuals matter."""
    sampling = SAMPLINGS[name]
    reference = engines.make_engine(chi_square_model, max_num_seqs=256)
    prompt = [5]

    def p_next(prefix: list[int]) -> torch.Tensor:
        logits = teacher_forced_logits(reference, prompt, [*prefix, 0])[len(prefix)]
        return processed_logprobs(logits[None], [sampling])[0].exp().double()

    p0 = p_next([])
    vocab = p0.numel()
    a, b, c = p0.topk(3).indices.tolist()
    pa, pb = p_next([a]), p_next([b])
    a1, b1 = int(pa.argmax()), int(pb.argmax())
    expected = [p0[a] * pa[a1], p0[a] * (1 - pa[a1]), p0[b] * pb[b1], p0[b] * (1 - pb[b1]), p0[c],
                1 - p0[a] - p0[b] - p0[c]]
    q0 = skewed_q(vocab, {c: 0.45, b: 0.25, a: 0.05})
    q1 = {a: skewed_q(vocab, {a1: 0.2}), b: skewed_q(vocab, {b1: 0.9})}
    walks = []
    walk = biased_rejection_walk if biased else tree_module.rejection_walk
    monkeypatch.setattr(tree_module, "rejection_walk", lambda *a: walks.append(1) or walk(*a))
    engine = make_engine(chi_square_model, SampledTree(vocab, q0, q1), max_num_seqs=256, kv_cache_memory_gb=0.05)
    for i in range(NUM_SAMPLES):
        engine.add_request(prompt, msgspec.structs.replace(sampling, seed=1000 + i), f"r{i}")
    done = run_to_completion(engine)
    assert engine.spec_stats.num_accepted > 0
    assert len(walks) >= NUM_SAMPLES  # every root was verified by rejection sampling over q
    counts = [0] * 6
    for out in done.values():
        t = out.token_ids
        if t[0] == a:
            counts[0 if t[1] == a1 else 1] += 1
        elif t[0] == b:
            counts[2 if t[1] == b1 else 3] += 1
        else:
            counts[4 if t[0] == c else 5] += 1
    p_value = chi_square_p_value(counts, [float(e) for e in expected])
    want = [round(NUM_SAMPLES * float(e)) for e in expected]
    if biased:
        assert p_value < 1e-6, (counts, want)
    else:
        assert p_value > 1e-3, (counts, want)


def test_sampled_tree_shapes_parse_and_print():
    shape = TreeShape.parse("5x4:16:sampled")
    assert shape == TreeShape(5, 4, 16, sampled=True) and shape.text == "5x4:16:sampled"
    assert TreeShape.parse("5x4:16") == TreeShape(5, 4, 16) and "sampled" in str(shape)
    for bad in ("5x4:16:random", "5x4:16:sampled:x", "5x4"):
        with pytest.raises(ValueError, match="DEPTHxWIDTH:NODES:sampled"):
            TreeShape.parse(bad)


def test_an_untrustworthy_q_row_falls_back_to_the_walk():
    """A q row that is not a distribution (NaN), leaves out a child, or a support that does not
    ascend: the node is walked as top-k children — the same tokens, uniform for uniform, as the
    same tree handed over without q."""
    vocab = 64
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 3  # root and two nodes
    support = torch.arange(vocab)
    good = torch.full((vocab,), 1 / vocab)
    nan = good.clone()
    nan[3] = float("nan")
    missing = good.clone()
    missing[int(logits[0].argmax())] = 0.0
    cases = [(support, {-1: nan}), (support, {-1: missing / missing.sum()}), (support.flip(0), {-1: good})]
    top = logits[0].topk(2).indices.tolist()
    for case_support, q in cases:
        broken = DraftTree(top, [-1, -1], None, case_support, q)
        plain = DraftTree(top, [-1, -1])
        out = []
        for tree in (broken, plain):
            seq = Sequence("r", None, 1, [1], SamplingParams(temperature=1.0, seed=3, max_tokens=4),
                           torch.Generator().manual_seed(3), 0, 5)
            out.append([(v.token_ids, v.path) for v in verify_trees(logits, [seq], [tree])])
        assert out[0] == out[1]


def test_a_capped_sampled_tree_keeps_its_q_rows_by_new_index():
    q = {-1: torch.tensor([0.5, 0.5]), 0: torch.tensor([0.2, 0.8]), 1: torch.tensor([0.9, 0.1])}
    tree = DraftTree([10, 11, 12, 13], [-1, -1, 0, 1], None, torch.tensor([10, 11]), q)
    capped = cap_tree(tree, max_depth=2, max_nodes=3)
    assert capped.tokens == [10, 11, 12] and set(capped.q) == {-1, 0, 1}
    shallow = cap_tree(tree, max_depth=1, max_nodes=4)
    assert shallow.tokens == [10, 11] and torch.equal(shallow.q[0], q[0])


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, seed=4),
], ids=["greedy", "t1"])
def test_eagle_sampled_trees_are_well_formed(tiny_checkpoint, sampling):
    """The head's sampled trees: each parent's children distinct and drawn from its q row (positive
    mass), at most ``width`` of them, at most ``nodes`` in all, by depth; greedy requests get top-k
    trees and plain greedy output."""
    path = tiny_checkpoint("llama")
    batch = prompts([9, 16, 23])
    shape = TreeShape.parse("3x3:8:sampled")
    engine, proposer = eagle_engine(path, shape.text)
    proposer.sample_drafts = True
    seen = []
    original = proposer.propose_tree
    proposer.propose_tree = lambda b, s: seen.extend(out := original(b, s)) or out  # type: ignore[method-assign]
    done = run(engine, batch, sampling, groups=True)
    drafted = [t for t in seen if len(t)]
    assert drafted and engine.spec_stats.num_drafted > 0
    for tree in drafted:
        depths = tree.depths()
        assert len(tree) <= shape.nodes and max(depths) <= shape.depth and depths == sorted(depths)
        for parent in {-1, *tree.parents}:
            kids = [tree.tokens[i] for i, p in enumerate(tree.parents) if p == parent]
            assert len(kids) == len(set(kids)) <= shape.width
            if sampling.greedy:
                assert tree.q is None
            elif kids:
                at = torch.searchsorted(tree.q_support, torch.tensor(kids))
                assert bool((tree.q[parent][at] > 0).all())
    if sampling.greedy:
        plain = run(engines.make_engine(path), batch, sampling)
        assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
