"""One decoder layer over the paged KV cache, as a flat sequence of torch calls: the inference hot path.

The model's modules (``model.py``) own the parameters and serve training; inference runs this
function over each layer's weights, fetched once (:class:`LayerWeights`), so a step pays for
its ~20 tensor ops per layer and not for module dispatch, attribute lookups and splits around
them. The maths is the modules' own (``DecoderLayer.forward_dense`` computes the same with a
dense mask): pre-norm attention with RoPE and GQA, residual, pre-norm SwiGLU, residual.
RoPE rotates q and k in one call (they are adjacent in the fused q/k/v output) unless the model
norms them per head first (Qwen3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specroll.engine import cpu_linear
from specroll.engine.attention import AttentionBackend
from specroll.engine.rope import apply_rope

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``linear(x, weight, bias)``: ``x @ weight.T + bias``, ``[..., in]`` → ``[..., out]``."""


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's parameters (the tensors themselves: in-place weight updates show) and sizes
    (``model.DecoderLayer.weights`` gathers them)."""

    input_norm: torch.Tensor
    """``[hidden]``."""
    qkv: torch.Tensor
    """``[(H + 2·H_kv)·D, hidden]``: rows q, k, v."""
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    """``[D]`` (Qwen3), else None; with ``k_norm``."""
    k_norm: torch.Tensor | None
    o: torch.Tensor
    """``[hidden, H·D]``."""
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    """``[2·I, hidden]``: rows gate, up."""
    down: torch.Tensor
    """``[hidden, I]``."""
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


def paged_layer(
    x: torch.Tensor,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    backend: AttentionBackend,
    linear: Linear = cpu_linear.linear,
) -> torch.Tensor:
    """One decoder layer for the step's new tokens, appending their K/V to ``kv_cache``.

    Args:
        x: ``[T, hidden]`` residual stream entering the layer.
        w: the layer's weights.
        cos, sin: ``[T, 1, D]`` from ``RotaryEmbedding.cos_sin``.
        kv_cache: the layer's cache ``[num_pages, 2, page_size, H_kv, D]``.
        backend: attention backend planned for this step.
        linear: the matmuls' implementation (a packed weight's oneDNN path by default,
            ``cpu_linear.py``; the compiled step's opaque op, ``compiled_step.py``).

    Returns:
        ``[T, hidden]`` the residual stream leaving the layer.
    """
    t, heads, kv_heads, d = x.shape[0], w.num_heads, w.num_kv_heads, w.head_dim
    hidden = x.shape[-1]
    qkv = linear(F.rms_norm(x, (hidden,), w.input_norm, w.eps), w.qkv, w.qkv_bias)  # [T, (H + 2 H_kv) D]
    heads_qk = heads + kv_heads
    qkv = qkv.view(t, heads_qk + kv_heads, d)  # [T, H + 2 H_kv, D]: q heads, k heads, v heads
    if w.q_norm is None or w.k_norm is None:
        qk = apply_rope(qkv[:, :heads_qk], cos, sin)  # [T, H + H_kv, D]
        q, k = qk[:, :heads], qk[:, heads:]
    else:  # Qwen3: each head's q and k normed before RoPE
        q = apply_rope(F.rms_norm(qkv[:, :heads], (d,), w.q_norm, w.eps), cos, sin)
        k = apply_rope(F.rms_norm(qkv[:, heads:heads_qk], (d,), w.k_norm, w.eps), cos, sin)
    v = qkv[:, heads_qk:]  # [T, H_kv, D]
    o = backend.forward(q, k, v, kv_cache)  # [T, H, D]
    x = x + linear(o.view(t, heads * d) if o.is_contiguous() else o.reshape(t, heads * d), w.o, None)
    gate_up = linear(F.rms_norm(x, (hidden,), w.post_norm, w.eps), w.gate_up, None)  # [T, 2 I]
    i = w.intermediate_size
    return x + linear(F.silu(gate_up[:, :i]) * gate_up[:, i:], w.down, None)


def paged_layers(
    x: torch.Tensor,
    weights: Sequence[LayerWeights],
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    backend: AttentionBackend,
    tap_layers: tuple[int, ...] = (),
    linear: Linear = cpu_linear.linear,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Every decoder layer in turn (:func:`paged_layer`), tapping the residual stream on the way.

    Args:
        x: ``[T, hidden]`` the embedded tokens.
        weights, kv_caches: each layer's weights and cache, in layer order.
        tap_layers: layers (ascending, each below ``len(weights)``) whose input residual stream is
            returned.

    Returns:
        ``[T, hidden]`` the residual stream leaving the last layer (before the final norm), and the
        taps ``[T, hidden]`` in ``tap_layers``' order.
    """
    taps = []
    for i, (w, kv_cache) in enumerate(zip(weights, kv_caches, strict=True)):
        if i in tap_layers:
            taps.append(x)
        x = paged_layer(x, w, cos, sin, kv_cache, backend, linear)
    return x, tuple(taps)
