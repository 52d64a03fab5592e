"""Tree speculation keeps the target distribution exactly: chi-square tests on the distribution of
the tokens emitted through a fixed draft tree (α = 0.001), which a deliberately biased verifier
(each child accepted on its own, without the residual update) fails."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import engines
from helpers.checkpoints import teacher_forced_logits
from helpers.engines import StandIn
from helpers.trees import chi_square_p_value

import specroll.engine.spec.modes as engine_module
from specroll.engine.driver import run_to_completion
from specroll.engine.sampler import processed_logprobs
from specroll.engine.spec.tree import DraftTree, TreeVerdict
from specroll.protocol.sampling import SamplingParams

make_engine = functools.partial(engines.make_engine, **engines.TREE_SPECULATION)


class FixedTree(StandIn):
    """The same tree for every request: root children A (q 0.05) and B (q 0.05), A → A1 → A2, B → B1."""

    def __init__(self, a: int, a1: int, a2: int, b: int, b1: int) -> None:
        self.tree = DraftTree([a, b, a1, b1, a2], [-1, -1, 0, 1, 2], [0.05, 0.05, 0.05, 0.05, 0.05])

    def propose_tree(self, batch, shape):
        return [self.tree if len(seq.token_ids) == 1 else DraftTree([], []) for seq in batch]


def biased_verify_trees(logits, seqs, trees, num_rows=None):
    """A broken verifier: each child is accepted with min(1, p/q) on its own, in order, without
    the residual update; when none is, the token is drawn from p (which may be a rejected child)."""
    if not callable(logits):
        table = logits
        logits = lambda rows: table[rows]  # noqa: E731
    starts, row = [], 0
    for tree in trees:
        starts.append(row)
        row += len(tree) + 1
    out = []
    for seq, tree, start in zip(seqs, trees, starts, strict=True):
        node, tokens, lps, path = -1, [], [], []
        while True:
            lp = processed_logprobs(logits(torch.tensor([start + node + 1])), [seq.sampling])[0]
            p = lp.exp().double()
            for i, (parent, token) in enumerate(zip(tree.parents, tree.tokens, strict=True)):
                u = torch.rand(1, dtype=torch.float64, generator=seq.generator).item()
                if parent == node and u * tree.draft_probs[i] < p[token]:
                    break
            else:
                u = torch.rand(1, dtype=torch.float64, generator=seq.generator)
                token = int(torch.searchsorted(p.cumsum(0), u * p.sum()).clamp(max=p.numel() - 1))
                tokens.append(token)
                lps.append(float(lp[token]))
                break
            tokens.append(token)
            lps.append(float(lp[token]))
            path.append(i)
            node = i
        out.append(TreeVerdict(tokens, lps, path))
    return out


SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    "t1_top_k": SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True),
    "t1_top_p": SamplingParams(temperature=1.0, top_p=0.7, max_tokens=3, ignore_eos=True),
}
NUM_SAMPLES = 1500
BIASED_SAMPLES = 300
"""The biased verifier's runs: it moves the bins so far (a noncentrality of 4.3 to 37 per sample against
these bins, measured from 1500 samples of it) that 300 samples miss p < 1e-6 with a probability below
1e-15, and 100 would do; the honest runs keep :data:`NUM_SAMPLES`, the power against subtler bias."""


@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("biased", [False, True], ids=["verifier", "biased_verifier"])
def test_chi_square_of_tree_sampling(chi_square_model, monkeypatch, name, biased):
    """Bins: the path through the tree the three emitted tokens follow (A A1 A2, A A1 ·, A ·, B B1,
    B ·, neither); their exact probabilities come from the target's teacher-forced distributions."""
    sampling = SAMPLINGS[name]
    reference = make_engine(chi_square_model, max_num_seqs=256)
    prompt = [5]

    def p_next(prefix: list[int]) -> torch.Tensor:
        logits = teacher_forced_logits(reference, prompt, [*prefix, 0])[len(prefix)]
        return processed_logprobs(logits[None], [sampling])[0].exp().double()

    p0 = p_next([])
    a, b = p0.topk(2).indices.tolist()  # likely children, so every bin is well filled
    pa, pb = p_next([a]), p_next([b])
    a1, b1 = int(pa.argmax()), int(pb.argmax())
    pa1 = p_next([a, a1])
    a2 = int(pa1.argmax())
    expected = [p0[a] * pa[a1] * pa1[a2], p0[a] * pa[a1] * (1 - pa1[a2]), p0[a] * (1 - pa[a1]),
                p0[b] * pb[b1], p0[b] * (1 - pb[b1]), 1 - p0[a] - p0[b]]
    if biased:
        monkeypatch.setattr(engine_module, "verify_trees", biased_verify_trees)
    engine = make_engine(chi_square_model, FixedTree(a, a1, a2, b, b1), max_num_seqs=256, kv_cache_memory_gb=0.05)
    num_samples = BIASED_SAMPLES if biased else NUM_SAMPLES
    for i in range(num_samples):
        engine.add_request(prompt, msgspec_replace(sampling, seed=1000 + i), f"r{i}")
    done = run_to_completion(engine)
    assert engine.spec_stats.num_accepted > 0
    counts = [0] * 6
    for c in done.values():
        t = c.token_ids
        if t[0] == a:
            counts[0 if t[1:] == [a1, a2] else 1 if t[1] == a1 else 2] += 1
        elif t[0] == b:
            counts[3 if t[1] == b1 else 4] += 1
        else:
            counts[5] += 1
    p_value = chi_square_p_value(counts, [float(e) for e in expected])
    want = [round(num_samples * float(e)) for e in expected]
    print(f"{name}, {'biased' if biased else 'honest'} verifier: counts {counts}, expected {want}, p = {p_value:.3g}")
    if biased:
        assert p_value < 1e-6, (counts, want)
    else:
        assert p_value > 1e-3, (counts, want)


def msgspec_replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)
