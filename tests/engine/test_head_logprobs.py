"""The chunked LM head of the training step (``engine/head_logprobs.py``): the same logprobs and the
same gradients as the whole head computed with plain autograd, for every chunk size — a chunk of
one token, chunks that do not divide N (a short last chunk), one chunk exactly N, one larger than
N — alone and through a tied tiny model; and its matmuls follow autocast."""

from __future__ import annotations

import pytest
import torch

from specroll.engine.head_logprobs import head_logprobs
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import Group, Sample
from specroll.rl.grpo_step import build_batch, response_logprobs

N, H, V = 37, 48, 1001


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)  # [N, H]
    weight = torch.randn(V, H, generator=gen) * 0.3  # [V, H]: logits of a few units, as a trained head's
    targets = torch.randint(0, V, (N,), generator=gen)  # [N]
    grad_out = torch.randn(N, generator=gen)  # [N]: per-token weights, as a policy-gradient loss has
    return hidden, weight, targets, grad_out


def _run(chunk: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight, targets, grad_out = _inputs(seed)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    lp = head_logprobs(hidden, weight, targets, chunk)
    (lp * grad_out).sum().backward()
    assert hidden.grad is not None and weight.grad is not None
    return lp.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 8, 36, 37, 64])
def test_chunked_head_equals_the_whole_head_in_fp32(chunk: int) -> None:
    full_lp, full_dh, full_dw = _run(0)
    lp, dh, dw = _run(chunk)
    assert lp.dtype == torch.float32 and lp.shape == (N,)
    torch.testing.assert_close(lp, full_lp, rtol=1e-6, atol=1e-6)  # logprobs ~7: a few float32 ulps, which
    torch.testing.assert_close(dh, full_dh, rtol=2e-6, atol=1e-6)  # the CPU's matmul kernels (AVX2, AVX512) set
    torch.testing.assert_close(dw, full_dw, rtol=2e-6, atol=1e-6)  # entries up to ~5: a few float32 ulps


def test_only_the_wanted_gradients_are_computed() -> None:
    hidden, weight, targets, grad_out = _inputs(1)
    hidden.requires_grad_(True)  # the head frozen: no [V, H] gradient is made
    (head_logprobs(hidden, weight, targets, 8) * grad_out).sum().backward()
    full = hidden.detach().clone().requires_grad_(True)
    (head_logprobs(full, weight, targets, 0) * grad_out).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, full.grad, rtol=2e-6, atol=1e-6)


def test_bad_shapes_and_chunks_are_refused() -> None:
    hidden, weight, targets, _ = _inputs(0)
    with pytest.raises(ValueError, match="chunk=-1"):
        head_logprobs(hidden, weight, targets, -1)
    with pytest.raises(ValueError, match=r"targets \(36,\)"):
        head_logprobs(hidden, weight, targets[:-1], 4)


def test_the_chunked_head_runs_its_matmuls_in_the_autocast_dtype() -> None:
    hidden, weight, targets, _ = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = head_logprobs(hidden, weight, targets, 8)
        whole = head_logprobs(hidden, weight, targets, 0)  # autocast's own bf16 linear
    exact = head_logprobs(hidden, weight, targets, 8)
    assert chunked.dtype == torch.float32
    # bf16 rounding of the inputs moves the logprobs (else autocast was ignored), by what it moves autocast's
    assert not torch.equal(chunked, exact)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=2e-2)
    torch.testing.assert_close(chunked, exact, rtol=0, atol=0.1)


def test_chunked_head_through_a_tied_model_gives_the_same_gradients(tiny_checkpoint) -> None:
    ckpt = load_checkpoint(tiny_checkpoint("llama", tie_word_embeddings=True))
    assert ckpt.config.tie_word_embeddings
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(3, ckpt.config.vocab_size, (n,), generator=gen).tolist()

    groups = [Group(f"g{g}", ids(4 + g), [Sample(ids(r), [-1.0] * r, [0] * r, "stop") for r in lengths],
                    SamplingParams()) for g, lengths in enumerate([[5, 2, 7], [3, 6, 1]])]
    batch = build_batch(groups, torch.zeros(2, 3), normalize_std=True, fill_version=0)
    weights = torch.randn(batch.loss_mask.shape, generator=gen)  # [B, L]
    results = []
    for chunk in (0, 4):
        model = CausalLM(ckpt.config)
        model.load_weights(ckpt.weights)
        lp = response_logprobs(model, batch, torch.arange(2), chunk)  # [B, L]
        (lp * weights).sum().backward()
        results.append((lp.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (full_lp, full_grads), (lp, grads) = results
    torch.testing.assert_close(lp, full_lp, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-6, msg=name)
