"""The attention-backend interface, the paged KV cache it reads, and backend selection.

A backend is planned once per step from the batch's :class:`AttentionMetadata` and then run once
per layer: it appends the step's new K/V to that layer's cache and attends, with the causal mask
aligned bottom-right (query row i of a sequence with q new tokens and K/V length L sees
positions ≤ L − q + i), as FlashInfer's ``causal=True`` does.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specroll.engine.batch import AttentionMetadata
from specroll.engine.model_config import ModelConfig


class AttentionBackend(Protocol):
    """Paged attention over a ragged batch."""

    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare this step's indices; called once per step, before any layer runs."""
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

    ``auto`` picks FlashInfer when the device is CUDA, the package imports and ``dtype`` is 16-bit
    (FlashInfer has no float32 attention); otherwise torch.

    Raises:
        ValueError: ``name`` is unknown, or ``flashinfer`` is forced without CUDA, without the
            package, or with float32.
    """
    from specroll.engine.torch_attention import TorchAttention

    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention backend {name!r}: expected 'auto', 'torch' or 'flashinfer'")
    reference = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim, device)
    if name == "torch":
        return reference
    if device.type != "cuda":
        if name == "auto":
            return reference
        raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, but the engine runs on {device}")
    if not flashinfer_available():
        if name == "auto":
            return reference
        raise ValueError("attention backend 'flashinfer' needs the flashinfer package: pip install 'specroll[cuda]'")
    if dtype == torch.float32:
        if name == "auto":
            return reference
        raise ValueError("attention backend 'flashinfer' runs bfloat16 or float16; got dtype float32")
    from specroll.engine.flashinfer_attention import FlashInferAttention

    return FlashInferAttention(config.num_heads, config.num_kv_heads, config.head_dim, device, dtype)


def flashinfer_available() -> bool:
    """Whether the ``flashinfer`` package is installed (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None
