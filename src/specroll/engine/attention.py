"""The attention-backend interface, the paged KV cache it reads, and backend selection.

A backend is planned once per step from the batch's :class:`AttentionMetadata` and then run once
per layer: it appends the step's new K/V to that layer's cache and attends, with the causal mask
aligned bottom-right (query row i of a sequence with q new tokens and K/V length L sees
positions ≤ L − q + i), as FlashInfer's ``causal=True`` does.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from specroll.engine.batch import AttentionMetadata
from specroll.engine.flashinfer_attention import FlashInferAttention
from specroll.engine.model_config import ModelConfig
from specroll.engine.torch_attention import TorchAttention


class AttentionBackend(Protocol):
    """Paged attention over a ragged batch."""

    def plan(self, meta: AttentionMetadata, graph: tuple[int, int] | None = None) -> None:
        """Prepare this step's indices; called once per step, before any layer runs.

        ``graph``: ``(bucket, q_len)`` when the step replays a CUDA graph (``step_graphs.py``) and
        ``meta`` is padded to ``bucket`` sequences of ``q_len`` tokens; a backend that captures
        plans into that bucket's fixed buffers, one that does not plans as for any step.
        """
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """Append ``k``/``v`` to ``kv_cache`` and attend.

        Args:
            q: ``[T, num_heads, head_dim]`` queries of the step's new tokens (RoPE applied).
            k: ``[T, num_kv_heads, head_dim]`` new keys (RoPE applied).
            v: ``[T, num_kv_heads, head_dim]`` new values.
            kv_cache: this layer's cache ``[num_pages, 2, page_size, num_kv_heads, head_dim]``.

        Returns:
            ``[T, num_heads, head_dim]`` attention output, in ``q``'s dtype.
        """
        ...


def kv_bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all layers (K and V)."""
    return config.kv_bytes_per_token * page_size * torch.finfo(dtype).bits // 8


def allocate_kv_cache(
    config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """One zeroed cache per layer: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``.

    Index 0 of the second dimension is K and 1 is V (FlashInfer's combined NHD layout).
    """
    shape = (num_pages, 2, page_size, config.num_kv_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]


def select_backend(
    name: str, config: ModelConfig, device: torch.device, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """Build the backend named by ``name`` (``auto``, ``torch`` or ``flashinfer``).

    ``auto`` picks FlashInfer when :func:`flashinfer_problem` finds nothing in the way (a CUDA
    device, a 16-bit dtype, a head size FlashInfer compiles, and a ``flashinfer`` package that
    imports); otherwise torch.

    Raises:
        ValueError: ``name`` is unknown, or ``flashinfer`` is forced where it cannot run (the
            message says why).
    """
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention backend {name!r}: expected 'auto', 'torch' or 'flashinfer'")
    reference = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim, device)
    if name == "torch":
        return reference
    problem = flashinfer_problem(device, dtype, config.head_dim)
    if problem is not None:
        if name == "auto":
            return reference
        raise ValueError(f"attention backend 'flashinfer' {problem}")
    return FlashInferAttention(config.num_heads, config.num_kv_heads, config.head_dim, device, dtype)


FLASHINFER_HEAD_DIMS = (64, 128, 256)
"""Head sizes FlashInfer's FA2 kernels are compiled for (``DISPATCH_HEAD_DIM``)."""


def flashinfer_problem(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why the FlashInfer backend cannot serve this engine (a phrase completing "attention backend
    'flashinfer' ..."), or None when it can. Cheap enough to call before loading a model (pass
    ``head_dim=None`` when it is not known yet)."""
    if device.type != "cuda":
        return f"needs a CUDA device, but the engine runs on {device}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"runs bfloat16 or float16; got dtype {str(dtype).removeprefix('torch.')}"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return f"supports head_dim {FLASHINFER_HEAD_DIMS}; the model has {head_dim}"
    if importlib.util.find_spec("flashinfer") is None:
        return "needs the flashinfer package: pip install -e '.[cuda]' (from a checkout) or 'specroll[cuda]'"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # a missing dependency or CUDA library: the message says which
        return f"is installed but does not import ({type(exc).__name__}: {exc})"
    return None
