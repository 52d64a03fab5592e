"""Token logprobs through the LM head, chunk by chunk, forward and backward, without ever holding
the ``[N, vocab]`` logits of every token (the training step's head; ``rl/grpo_step.py``).

A GRPO step needs ``log softmax(h_i W^T)[t_i]`` for each of N response tokens. Materialising the
logits costs ``N × V`` floats (SmolLM2's V = 49,152: 94 MB for 480 tokens in float32, and as much
again for their gradient and the softmax autograd saves); here they exist for ``chunk`` tokens at a
time. The forward keeps only the log-normaliser ``lse_i`` of each token; the backward recomputes a
chunk's logits and takes the gradient of the logprob in closed form,

    ∂ log p_i[t_i] / ∂ z_ij = 1[j = t_i] − p_ij,      p_ij = exp(z_ij − lse_i)

so ``dz = g_i (onehot(t_i) − p_i)`` per chunk, then ``dh = dz W`` and ``dW += dzᵀ h`` (the chunked
fused linear cross-entropy of Liger Kernel, Hsu et al. 2024, arXiv 2410.10989, §3.3, written for
per-token weights: Liger's own kernel folds the gradient into its forward and scales it by one
scalar in the backward, which a policy-gradient loss, whose weight differs per token, cannot use;
and it is Triton, so CUDA only). One extra head matmul per chunk buys the memory.

Precision: the matmuls run in the autocast dtype when autocast is on for the tensors' device
(``trainer.precision = "bf16"``), else in the weight's dtype; logits, the log-softmax and the
returned logprobs are always float32, and ``dW`` is accumulated in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["head_logprobs"]


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """``log softmax(hidden @ weight.T)[targets]``: float32 ``[N]``, differentiable in ``hidden``
    and ``weight``.

    Args:
        hidden: ``[N, hidden_size]`` final normed hidden states (any float dtype).
        weight: ``[vocab_size, hidden_size]`` the LM head (the embedding when tied).
        targets: int64 ``[N]`` token ids in ``[0, vocab_size)``.
        chunk: tokens whose logits exist at once (module docstring); 0 computes the whole
            ``[N, vocab_size]`` head with plain autograd (the reference the chunked path must equal).

    Raises:
        ValueError: shapes disagree, or ``chunk`` < 0.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] \
            or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H], weight [V, H] and targets [N]; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}, targets {tuple(targets.shape)}")
    if chunk < 0:
        raise ValueError(f"chunk={chunk}, expected an integer >= 0 (0: the whole head at once)")
    if chunk == 0:
        logits = F.linear(hidden, weight).float()  # [N, V]
        return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)
    out = _ChunkedHeadLogprobs.apply(hidden, weight, targets, chunk, _matmul_dtype(hidden, weight))
    assert isinstance(out, torch.Tensor)
    return out


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run the head's matmul in (its dtype when on), else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """The chunked head (module docstring); autocast is off inside, the dtype is chosen explicitly."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                dtype: torch.dtype) -> torch.Tensor:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]: log Σ_j exp z_ij
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)  # [N, H], [V, H]
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                logits = (h[start:end] @ w.T).float()  # [c, V]
                lse[start:end] = logits.logsumexp(-1)
                out[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - lse[start:end]
        # the cast weight too (no second cast in the backward; it is the weight itself in its own dtype)
        ctx.save_for_backward(hidden, weight, targets, lse, w)
        ctx.chunk, ctx.dtype = chunk, dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, w = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None  # [N, H]
        grad_w: torch.Tensor | None = None  # [V, H] float32, made by the first chunk
        g = grad_out.float()  # [N]
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                logits = (h[start:end] @ w.T).float()  # [c, V]
                # dz = g (onehot(t) − p): p = exp(z − lse), scaled by −g in place, then +g at the target
                dz = logits.sub_(lse[start:end, None]).exp_().mul_(-g[start:end, None])  # [c, V]
                dz.scatter_add_(-1, targets[start:end, None], g[start:end, None])
                dz_m = dz.to(dtype)
                if grad_h is not None:
                    grad_h[start:end] = dz_m @ w  # [c, H]
                if need_w and grad_w is None:
                    grad_w = (dz_m.T @ h[start:end]).float()  # [V, H]
                elif need_w and dtype == torch.float32:
                    grad_w.addmm_(dz_m.T, h[start:end])  # in place
                elif need_w:
                    grad_w += dz_m.T @ h[start:end]  # in bf16, added in float32
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype), None, None, None)
