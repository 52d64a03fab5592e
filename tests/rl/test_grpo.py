"""GRPO maths on small hand-computed examples: advantages, token logprobs, staleness, TIS and PPO losses."""

from __future__ import annotations

import math

import pytest
import torch

from specroll.rl.grpo import apply_staleness, group_advantages, policy_loss, staleness_mask, token_logprobs

# ---------------------------------------------------------------- group_advantages


def test_group_advantages_normalizes_by_unbiased_group_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    got = group_advantages(rewards)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 1: mean 2, std sqrt(2 / 3)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2 / 3)
    expected = torch.tensor([[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [1 / s1, -1 / s1, 0.0, 0.0]])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32


def test_group_advantages_without_std_is_dr_grpo():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    got = group_advantages(rewards, normalize_std=False)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_are_exactly_zero_for_equal_rewards(normalize_std):
    # 0.7 seven times: the float32 mean is not exactly 0.7, so (r - mean) / (0 + eps) would be ~0.06
    rewards = torch.stack([torch.full((7,), 0.7), torch.zeros(7), torch.tensor([1.0, 0, 0, 0, 0, 0, 0])])
    got = group_advantages(rewards, normalize_std=normalize_std)
    assert torch.equal(got[:2], torch.zeros(2, 7))
    assert got[2, 0] > 0 and (got[2, 1:] < 0).all()


def test_group_advantages_single_sample_groups_get_zero():
    assert torch.equal(group_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 2, 2), torch.zeros(2, 3, dtype=torch.int64)])
def test_group_advantages_rejects_bad_rewards(bad):
    with pytest.raises(ValueError, match=r"rewards must be float \[G, n\], got .*" + str(tuple(bad.shape))[1:-1]):
        group_advantages(bad)


# ---------------------------------------------------------------- token_logprobs


def test_token_logprobs_hand_example():
    # position 0 predicts token 1 with p = 3/4; position 1 predicts token 0 with p = 1/2
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0], [9.0, -9.0]]])  # [1, 3, 2]
    ids = torch.tensor([[0, 1, 0]])
    torch.testing.assert_close(token_logprobs(logits, ids), torch.tensor([[0.0, math.log(0.75), math.log(0.5)]]))


def test_token_logprobs_match_gather_of_log_softmax_and_are_differentiable():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 6, 11, generator=g) * 4).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 11, (3, 6), generator=g)
    got = token_logprobs(logits, ids)
    expected = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.dtype == torch.float32 and got.shape == (3, 6)
    assert torch.equal(got[:, 0], torch.zeros(3))
    torch.testing.assert_close(got[:, 1:], expected, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    assert logits.grad is not None and logits.grad[:, :-1].abs().sum() > 0


def test_token_logprobs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \(2, 5, 7\), input_ids \(2, 4\)"):
        token_logprobs(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.int64))


# ---------------------------------------------------------------- staleness


VERSIONS = torch.tensor([[0, 0, 3, 2, 1], [5, 5, 5, 5, 5], [0, 4, 4, 3, 3]])
LOSS_MASK = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)


def test_staleness_mask_bounds_the_version_lag():
    fresh = staleness_mask(VERSIONS, current_version=5, max_staleness=2)  # keep versions >= 3
    expected = torch.tensor([[0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(fresh, expected)
    assert staleness_mask(VERSIONS, 5, 0).sum() == 5  # only version 5 itself


def test_apply_staleness_mask_policy_removes_only_stale_trained_tokens():
    new_mask, masked, dropped = apply_staleness(LOSS_MASK, VERSIONS, 5, 2, "mask")
    # row 0 loses its version-2 and version-1 tokens; row 2's stale token 0 is outside the loss
    expected = LOSS_MASK.clone()
    expected[0, 3:] = False
    assert torch.equal(new_mask, expected)
    assert (masked, dropped) == (2, 0)


def test_apply_staleness_drop_policy_removes_whole_samples():
    new_mask, masked, dropped = apply_staleness(LOSS_MASK, VERSIONS, 5, 2, "drop")
    expected = LOSS_MASK.clone()
    expected[0] = False
    assert torch.equal(new_mask, expected)
    assert (masked, dropped) == (3, 1)


def test_apply_staleness_keeps_everything_within_the_bound():
    for policy in ("mask", "drop"):
        new_mask, masked, dropped = apply_staleness(LOSS_MASK, VERSIONS, 5, 4, policy)
        assert torch.equal(new_mask, LOSS_MASK) and (masked, dropped) == (0, 0)


def test_apply_staleness_rejects_bad_input():
    with pytest.raises(ValueError, match=r"newer than the current version 4"):
        apply_staleness(LOSS_MASK, VERSIONS, 4, 2, "mask")  # row 1 holds version-5 tokens
    with pytest.raises(ValueError, match=r"max_staleness must be >= 0, got -1"):
        apply_staleness(LOSS_MASK, VERSIONS, 5, -1, "mask")
    with pytest.raises(ValueError, match=r"'skip'"):
        apply_staleness(LOSS_MASK, VERSIONS, 5, 2, "skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"versions must be \[B, T\] = \(3, 5\), got \(3, 4\)"):
        apply_staleness(LOSS_MASK, VERSIONS[:, :4], 5, 2, "mask")
    with pytest.raises(ValueError, match=r"loss_mask must be bool"):
        apply_staleness(LOSS_MASK.long(), VERSIONS, 5, 2, "mask")


# ---------------------------------------------------------------- policy_loss


def _batch():
    """Two samples of four tokens; token 0 of each is a prompt token (untrained)."""
    logp = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-3.0, -1.5, -0.7, -0.2]])
    behavior = torch.tensor([[-9.0, -0.7, -1.0, -0.3], [-9.0, -1.0, -2.5, -0.2]])
    adv = torch.tensor([1.5, -0.5])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    return logp, behavior, adv, mask


def test_tis_loss_matches_the_hand_written_formula_and_its_gradient():
    logp, behavior, adv, mask = _batch()
    cap = 2.0
    leaf = logp.clone().requires_grad_()
    loss, metrics = policy_loss(leaf, behavior, adv, mask, kind="tis", tis_cap=cap)
    loss.backward()

    total, n, weights, grad = 0.0, 6, [], torch.zeros(2, 4)
    for b in range(2):
        for t in range(1, 4):
            w = min(math.exp(logp[b, t].item() - behavior[b, t].item()), cap)
            weights.append(w)
            total += -w * adv[b].item() * logp[b, t].item()
            grad[b, t] = -w * adv[b].item() / n
    assert loss.item() == pytest.approx(total / n, rel=1e-6)
    torch.testing.assert_close(leaf.grad, grad)
    # descent raises logp of positive-advantage tokens (sample 0) and lowers negative ones (sample 1)
    assert (leaf.grad[0, 1:] < 0).all() and (leaf.grad[1, 1:] > 0).all()
    assert metrics["tokens"] == 6
    assert metrics["is_weight_mean"] == pytest.approx(sum(weights) / 6, rel=1e-6)
    assert metrics["truncated_fraction"] == pytest.approx(1 / 6)  # only exp(-0.7 + 2.5) = 6.05 > 2
    assert metrics["clip_fraction"] == 0.0
    rho = [math.exp(logp[b, t].item() - behavior[b, t].item()) for b in range(2) for t in range(1, 4)]
    assert metrics["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 6, rel=1e-5)


def test_tis_gradient_step_moves_the_model_towards_positive_advantages():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=g).requires_grad_()
    ids = torch.randint(0, 7, (2, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    before = token_logprobs(logits, ids).detach()
    loss, _ = policy_loss(token_logprobs(logits, ids), before, adv, mask, kind="tis")
    loss.backward()
    with torch.no_grad():
        after = token_logprobs(logits - 0.5 * logits.grad, ids)
    assert after[0, 1:].sum() > before[0, 1:].sum()
    assert after[1, 1:].sum() < before[1, 1:].sum()


def test_tis_weights_are_truncated_at_the_cap():
    logp = torch.zeros(1, 3, requires_grad=True)
    behavior = torch.tensor([[0.0, -3.0, -0.5]])  # ratios 1, e^3 ≈ 20, e^0.5 ≈ 1.65
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = policy_loss(logp, behavior, torch.tensor([1.0]), mask, kind="tis", tis_cap=2.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[1.0, 2.0, math.exp(0.5)]]) / 3)
    assert metrics["truncated_fraction"] == pytest.approx(1 / 3)
    assert metrics["is_weight_mean"] == pytest.approx((1 + 2 + math.exp(0.5)) / 3, rel=1e-6)


def test_ppo_clip_stops_the_gradient_only_beyond_the_trust_region_in_the_direction_of_a():
    eps, cap = 0.2, 2.0
    prox = torch.zeros(1, 4)
    r = torch.tensor([[1.5, 1.5, 0.5, 0.5]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    behavior = torch.tensor([[0.0, 0.0, -0.4, -2.0]])  # behaviour weights 1, 1, e^0.4, capped at 2
    logp = r.log().requires_grad_()
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = policy_loss(logp, behavior, adv, mask, kind="ppo", clip_eps=eps, tis_cap=cap,
                                proximal_logprobs=prox)
    loss.backward()
    w = torch.tensor([[1.0, 1.0, math.exp(0.4), 2.0]])
    # r=1.5, A>0: clipped at 1.2 (no grad); r=1.5, A<0: unclipped; r=0.5, A<0: clipped at 0.8 (no
    # grad); r=0.5, A>0: unclipped. d/dlogp of -w r A is -w r A.
    expected_grad = torch.tensor([[0.0, -1.0 * 1.5 * -1.0, 0.0, -2.0 * 0.5 * 1.0]]) / 4
    torch.testing.assert_close(logp.grad, expected_grad)
    terms = [1.2 * 1.0, 1.5 * -1.0, 0.8 * -1.0, 0.5 * 1.0]
    expected_loss = -sum(wi * ti for wi, ti in zip(w[0].tolist(), terms, strict=True)) / 4
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["truncated_fraction"] == pytest.approx(0.25)


def test_ppo_without_proximal_is_ratio_one_and_equals_tis():
    logp, behavior, adv, mask = _batch()
    a = logp.clone().requires_grad_()
    b = logp.clone().requires_grad_()
    loss_ppo, m_ppo = policy_loss(a, behavior, adv, mask, kind="ppo")
    loss_tis, _ = policy_loss(b, behavior, adv, mask, kind="tis")
    loss_ppo.backward()
    loss_tis.backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert m_ppo["clip_fraction"] == 0.0
    # the values differ (TIS carries log π, PPO the ratio 1) but both are −Σ w A · (·) / N
    w = torch.exp(logp - behavior).clamp(max=2.0)
    assert loss_ppo.item() == pytest.approx(-(w * adv[:, None])[mask].sum().item() / 6, rel=1e-6)


@pytest.mark.parametrize("kind", ["tis", "ppo"])
def test_masked_tokens_contribute_nothing(kind):
    logp, behavior, adv, mask = _batch()
    adv_tok = adv[:, None].expand(2, 4).clone()
    prox = logp - 0.1
    mask[1, 2] = False

    def run(logp, behavior, adv_tok, prox):
        leaf = logp.clone().requires_grad_()
        loss, metrics = policy_loss(leaf, behavior, adv_tok, mask, kind=kind, proximal_logprobs=prox)
        loss.backward()
        return loss.detach(), leaf.grad, metrics

    loss0, grad0, metrics0 = run(logp, behavior, adv_tok, prox)
    junk = ~mask
    values = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(2)[: int(junk.sum())]
    logp2, behavior2, adv2, prox2 = logp.clone(), behavior.clone(), adv_tok.clone(), prox.clone()
    logp2[junk], behavior2[junk], adv2[junk], prox2[junk] = -7.0, values, values.flip(0), 30.0
    loss1, grad1, metrics1 = run(logp2, behavior2, adv2, prox2)
    assert torch.equal(loss0, loss1)
    assert torch.equal(grad0, grad1)
    assert torch.equal(grad1[junk], torch.zeros(int(junk.sum())))
    assert metrics0 == metrics1 and metrics0["tokens"] == 5


def test_num_tokens_sets_the_token_mean_denominator_and_empty_masks_are_zero():
    logp, behavior, adv, mask = _batch()
    full, _ = policy_loss(logp, behavior, adv, mask, kind="tis")
    half, _ = policy_loss(logp, behavior, adv, mask, kind="tis", num_tokens=12)
    assert half.item() == pytest.approx(full.item() / 2, rel=1e-6)

    leaf = logp.clone().requires_grad_()
    loss, metrics = policy_loss(leaf, behavior, adv, torch.zeros_like(mask), kind="ppo")
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(leaf.grad, torch.zeros(2, 4))
    assert metrics == {"is_weight_mean": 0.0, "truncated_fraction": 0.0, "clip_fraction": 0.0,
                       "approx_kl": 0.0, "tokens": 0}


def test_policy_loss_rejects_bad_input():
    logp, behavior, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"behavior_logprobs must be \[B, T\] = \(2, 4\), got \(2, 3\)"):
        policy_loss(logp, behavior[:, :3], adv, mask, kind="tis")
    with pytest.raises(ValueError, match=r"advantages must be \[B\] or \[B, T\] for logprobs \(2, 4\), got \(3,\)"):
        policy_loss(logp, behavior, torch.zeros(3), mask, kind="tis")
    with pytest.raises(ValueError, match=r"loss_mask must be bool"):
        policy_loss(logp, behavior, adv, mask.float(), kind="tis")
    with pytest.raises(ValueError, match=r"proximal_logprobs must be \[B, T\]"):
        policy_loss(logp, behavior, adv, mask, kind="ppo", proximal_logprobs=logp[0])
    with pytest.raises(ValueError, match=r"'grpo'"):
        policy_loss(logp, behavior, adv, mask, kind="grpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tis_cap must be > 0, got 0"):
        policy_loss(logp, behavior, adv, mask, kind="tis", tis_cap=0)
    with pytest.raises(ValueError, match=r"clip_eps must be in \(0, 1\), got 1.5"):
        policy_loss(logp, behavior, adv, mask, kind="ppo", clip_eps=1.5)
