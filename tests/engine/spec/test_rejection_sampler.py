"""Chain rejection sampling keeps the target distribution exactly (chi-square at α = 0.001)."""

from __future__ import annotations

import pytest
import torch

from specroll.engine.sampler import processed_logprobs
from specroll.engine.spec.verify import chain_rejection_sample
from specroll.protocol.sampling import SamplingParams

V, K, N = 6, 3, 200_000
ALPHA = 1e-3


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``samples`` (token ids) against ``probs`` [V]."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    support = expected > 0
    assert observed[~support].sum() == 0, "a token outside the target's support was emitted"
    stat = ((observed[support] - expected[support]) ** 2 / expected[support]).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)  # target, per position
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)  # draft, per position
    return p, q


def run(p: torch.Tensor, q: torch.Tensor | None, draft_from: torch.Tensor, seed: int = 0, greedy: bool = False):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(draft_from[i], N, replacement=True, generator=g) for i in range(K)], 1)
    return chain_rejection_sample(
        target_probs=p.expand(N, K + 1, V),
        draft_token_ids=drafts,
        num_drafts=torch.full((N,), K),
        draft_probs=None if q is None else q.expand(N, K, V),
        accept_uniform=torch.rand(N, K, dtype=torch.float64, generator=g),
        sample_uniform=torch.rand(N, dtype=torch.float64, generator=g),
        greedy=torch.full((N,), greedy),
    )


def check_lossless(p: torch.Tensor, out) -> None:
    # First emitted token ~ p_0; given d_0 accepted, the second ~ p_1; given d_0, d_1 accepted, ~ p_2.
    for i in range(K):
        rows = out.num_accepted >= i
        assert chi_square_p_value(out.token_ids[rows, i], p[i]) > ALPHA, f"position {i}"


def test_sampled_drafts_keep_the_target_distribution():
    p, q = tables(0)
    out = run(p, q, draft_from=q)
    check_lossless(p, out)
    assert 0 < out.num_accepted.float().mean() < K  # both accepts and rejections happened


def test_one_hot_drafts_keep_the_target_distribution():
    p, q = tables(1)
    check_lossless(p, run(p, None, draft_from=q))  # drafts from q, verified as one-hot


def test_processed_distributions_keep_the_target_distribution():
    p_raw, q = tables(2)
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.8)] * (K + 1)
    p = processed_logprobs(torch.log(p_raw), params).exp()  # [K+1, V] with zeros outside the filters
    assert (p == 0).any()
    out = run(p, q, draft_from=q)
    check_lossless(p, out)


def test_a_biased_verifier_is_caught():
    """The chi-square check has power: it rejects the two classic mistakes."""
    p_raw, q = tables(3)
    p = processed_logprobs(torch.log(p_raw), [SamplingParams(temperature=1.0, top_k=3)] * (K + 1)).exp()
    # 1. Accept by min(1, p/q) but resample a rejected position from p instead of max(0, p - q).
    out = run(p, q, draft_from=q)
    first = out.token_ids[:, 0].clone()
    rejected = out.num_accepted == 0
    g = torch.Generator().manual_seed(5)
    first[rejected] = torch.multinomial(p[0], int(rejected.sum()), replacement=True, generator=g)
    assert chi_square_p_value(first, p[0]) < ALPHA
    # 2. Verify against the unfiltered target (top-k applied after the comparison): tokens outside
    #    the filtered support come out.
    out = run(p_raw, q, draft_from=q)
    with pytest.raises(AssertionError, match="outside the target's support"):
        chi_square_p_value(out.token_ids[:, 0], p[0])


def test_greedy_accepts_exactly_the_argmax_prefix():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]])  # argmax 1, 0, 2
    drafts = torch.tensor([[1, 0], [1, 2], [2, 0]])
    out = chain_rejection_sample(
        p.expand(3, 3, 3), drafts, torch.tensor([2, 2, 1]), None,
        torch.rand(3, 2, dtype=torch.float64), torch.rand(3, dtype=torch.float64), torch.ones(3, dtype=torch.bool),
    )
    assert out.num_accepted.tolist() == [2, 1, 0]
    assert out.token_ids.tolist() == [[1, 0, 2], [1, 0, -1], [1, -1, -1]]


def test_no_drafts_is_plain_sampling_from_p0():
    p, _ = tables(4)
    g = torch.Generator().manual_seed(9)
    out = chain_rejection_sample(
        p.expand(N, K + 1, V), torch.zeros(N, K, dtype=torch.long), torch.zeros(N, dtype=torch.long), None,
        torch.rand(N, K, dtype=torch.float64, generator=g), torch.rand(N, dtype=torch.float64, generator=g),
        torch.zeros(N, dtype=torch.bool),
    )
    assert (out.num_accepted == 0).all() and (out.token_ids[:, 1:] == -1).all()
    assert chi_square_p_value(out.token_ids[:, 0], p[0]) > ALPHA
