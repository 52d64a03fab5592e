"""The packed GRPO batch: each group's prompt once, then its responses, each attending to the prompt
and itself. Checked by hand on a small layout and against the plain ``prompt + response`` forward
(``CausalLM.score``) on tiny random-weight models: the same logprobs and the same gradients."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import Group, Sample
from specroll.rl.grpo import LossKind, StalenessPolicy, token_logprobs
from specroll.rl.grpo_step import build_batch, policy_optimizer, precision_context, response_logprobs, train_step
from specroll.rl.step_result import Precision


def test_packed_layout_by_hand() -> None:
    group = Group("g0", [7, 8, 9], [Sample([1, 2], [-0.5, -1.5], [3, 4], "stop"),
                                    Sample([5], [-2.0], [4], "length"), Sample([], [], [], "abort")],
                  SamplingParams(max_tokens=4))
    batch = build_batch([group], torch.tensor([[1.0, 0.0, 0.0]]), normalize_std=False, fill_version=4)
    assert batch.input_ids.tolist() == [[7, 8, 9, 1, 2, 5]]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4, 3]]  # every response continues the prompt
    assert batch.segments.tolist() == [[0, 0, 0, 1, 1, 2]]
    assert batch.row_lengths.tolist() == [6]
    assert batch.predecessor.tolist() == [[2, 3], [2, 0], [0, 0]]  # the last prompt token predicts token 0
    assert batch.targets.tolist() == [[1, 2], [5, 0], [0, 0]]
    assert batch.loss_mask.tolist() == [[True, True], [True, False], [False, False]]
    assert batch.behavior_logprobs.tolist() == [[-0.5, -1.5], [-2.0, 0.0], [0.0, 0.0]]
    assert batch.versions.tolist() == [[3, 4], [4, 4], [4, 4]]
    torch.testing.assert_close(batch.advantages, torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    mask = batch.attention_mask(torch.tensor([0]), 6)[0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0],
                    [1, 1, 1, 0, 0, 0],
                    [1, 1, 1, 1, 0, 0],
                    [1, 1, 1, 1, 1, 0],
                    [1, 1, 1, 0, 0, 1]]  # response 2 sees the prompt and itself, not response 1


def _groups(vocab: int, seed: int) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    groups = []
    for g, (prompt_len, lengths) in enumerate([(5, [4, 1, 7]), (9, [3, 3, 0]), (2, [6, 2, 5])]):
        samples = [Sample(ids(r), [-1.0] * r, [0] * r, "stop") for r in lengths]
        groups.append(Group(f"g{g}", ids(prompt_len), samples, SamplingParams()))
    return groups


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_logprobs_and_gradients_equal_the_plain_forward(tiny_checkpoint, arch: str) -> None:
    ckpt = load_checkpoint(tiny_checkpoint(arch))
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    groups = _groups(ckpt.config.vocab_size, seed=0)
    batch = build_batch(groups, torch.zeros(3, 3), normalize_std=True, fill_version=0)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))  # [B, L]

    packed = response_logprobs(model, batch, torch.arange(3))  # [B, L]
    (packed * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    plain = torch.zeros_like(packed)
    loss = torch.zeros(())
    for g, group in enumerate(groups):
        for i, s in enumerate(group.samples):
            if not s.token_ids:
                continue
            ids = torch.tensor([group.prompt_token_ids + s.token_ids])
            lp = token_logprobs(model.score(ids, torch.ones_like(ids, dtype=torch.bool)), ids)[0, -len(s.token_ids):]
            b = g * 3 + i
            plain[b, : len(s.token_ids)] = lp.detach()
            loss = loss + (lp * weights[b, : len(s.token_ids)]).sum()
    loss.backward()

    torch.testing.assert_close(packed.detach(), plain, rtol=0, atol=1e-5)
    assert (packed[~batch.loss_mask] == 0).all()
    for p, g_packed in zip(model.parameters(), packed_grads, strict=True):
        torch.testing.assert_close(g_packed, p.grad, rtol=1e-3, atol=1e-4)


@dataclass(frozen=True)
class Settings:
    """What ``train_step`` reads of the trainer's config (``StepSettings``)."""

    max_staleness: int = 1
    staleness_policy: StalenessPolicy = "mask"
    loss: LossKind = "tis"
    tis_cap: float = 2.0
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    grad_accum_steps: int = 2
    precision: Precision = "fp32"
    head_chunk: int = 0


def test_the_thread_budget_hook_runs_before_each_phase(tiny_checkpoint) -> None:
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    batch = build_batch(_groups(ckpt.config.vocab_size, seed=0), torch.rand(3, 3), normalize_std=True,
                        fill_version=0)
    calls: list[int] = []
    train_step(model, torch.optim.AdamW(model.parameters()), batch, 0, Settings(), lambda: calls.append(1))
    assert len(calls) == 5  # 3 groups in 2 micro-batches: each one's forward and backward, then AdamW


@pytest.mark.parametrize("policy", ["mask", "drop"])
def test_a_batch_with_every_token_stale_takes_no_optimizer_step(tiny_checkpoint, policy: StalenessPolicy) -> None:
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    settings = Settings(staleness_policy=policy)
    batch = build_batch(_groups(ckpt.config.vocab_size, seed=0), torch.rand(3, 3), normalize_std=True,
                        fill_version=0)  # every token sampled by version 0
    trained = train_step(model, optimizer, batch, 1, settings)  # lag 1 = η: an update, AdamW has momentum now
    assert not trained.skipped and trained.trained_tokens == int(batch.loss_mask.sum())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    steps = [float(s["step"]) for s in optimizer.state.values()]

    stale = train_step(model, optimizer, batch, 2, settings)  # lag 2 > η = 1: nothing left to train
    # an AdamW step on zero gradients would still move every weight (decay, momentum)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert [float(s["step"]) for s in optimizer.state.values()] == steps
    assert stale.skipped and stale.trained_tokens == 0 and stale.loss == 0.0 and stale.staleness == {}
    if policy == "mask":
        assert (stale.tokens_masked_stale, stale.samples_dropped_stale) == (int(batch.loss_mask.sum()), 0)
    else:
        assert stale.samples_dropped_stale == 8  # every sample with a token (one of the 9 is empty)


def test_a_bf16_step_matches_the_fp32_step_within_tolerance(tiny_checkpoint) -> None:
    """``trainer.precision = "bf16"``: autocast over float32 master weights. Stated tolerance, on a
    tiny model whose logits span several nats (measured: 0.047 max, 0.019 mean, cosine 0.9997, norms
    within 4%): logprobs within 0.15 nats of float32 (mean 0.04), the gradient within 5% of float32's
    norm and pointing the same way (cosine ≥ 0.995), the step's loss and gradient norm within 8%;
    parameters and AdamW's state stay float32."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    groups = _groups(ckpt.config.vocab_size, seed=0)
    batch = build_batch(groups, torch.rand(3, 3, generator=torch.Generator().manual_seed(2)), normalize_std=True,
                        fill_version=0)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))  # [B, L]
    logprobs, grads, results = {}, {}, {}
    for precision in ("fp32", "bf16"):
        model = CausalLM(ckpt.config)
        model.load_weights(ckpt.weights)
        with precision_context(precision, torch.device("cpu")):
            lp = response_logprobs(model, batch, torch.arange(3), head_chunk=4)  # [B, L]
        (lp * weights).sum().backward()
        logprobs[precision] = lp.detach()
        grads[precision] = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad()
        optimizer = policy_optimizer(model.parameters(), 1e-3, 0.0)
        results[precision] = train_step(model, optimizer, batch, 0, Settings(precision=precision, head_chunk=4))
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(v.dtype == torch.float32 for s in optimizer.state.values() for k, v in s.items() if k != "step")
    diff = (logprobs["bf16"] - logprobs["fp32"]).abs()[batch.loss_mask]
    assert 0 < diff.max() <= 0.15 and diff.mean() <= 0.04, (diff.max(), diff.mean())  # > 0: bf16 took effect
    g32, g16 = grads["fp32"], grads["bf16"]
    assert torch.nn.functional.cosine_similarity(g32, g16, dim=0) >= 0.995
    assert abs(g16.norm() / g32.norm() - 1) <= 0.05
    for key in ("loss", "grad_norm"):
        a, b = getattr(results["fp32"], key), getattr(results["bf16"], key)
        assert abs(a - b) <= 0.08 * abs(a), (key, a, b)
