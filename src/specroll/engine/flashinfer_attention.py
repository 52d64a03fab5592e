"""Paged attention through FlashInfer on CUDA: the generator's fast backend.

One step is planned once (:func:`plan_arguments` builds FlashInfer's arguments from the engine's
:class:`~specroll.engine.batch.AttentionMetadata`, a pure function tested on CPU) and run once per
layer: ``append_paged_kv_cache`` writes the step's new K/V into the pages, then a
``BatchDecodeWithPagedKVCacheWrapper`` (every sequence has one new token) or a
``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (prefill chunks, speculative verifies of
k + 1 tokens, mixed batches) attends, with the mask aligned bottom-right as the torch reference does.
FlashInfer docs: "KV-Cache Layout in FlashInfer" and the wrappers' docstrings (flashinfer-python
0.6.18–0.7.x); the traps are listed in the team's FlashInfer notes.

``flashinfer`` is imported only when a backend is built, so this module imports on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specroll.engine.batch import AttentionMetadata

WORKSPACE_BYTES = 128 * 2**20
"""FlashInfer's float workspace (the size its docs recommend), allocated once per backend."""

_DECODE_GROUP_SIZES = (1, 2, 3, 4)
"""GQA group sizes the CUDA-core decode kernels serve well; larger groups use tensor cores
(FlashInfer compiles CUDA-core decode only for 1, 2, 3, 4, 6, 8, 16, and tensor cores win there)."""


@dataclass(frozen=True)
class FlashInferPlan:
    """FlashInfer's arguments for one step (all int32, on the CPU).

    Attributes:
        qo_indptr: ``[B+1]`` query rows of each sequence.
        kv_indptr: ``[B+1]`` pages of each sequence in ``kv_indices``.
        kv_indices: ``[kv_indptr[-1]]`` page ids.
        kv_last_page_len: ``[B]`` tokens on each last page, in ``[1, page_size]``.
        batch_indices: ``[T]`` the sequence of each new token (``append_paged_kv_cache``).
        positions: ``[T]`` each new token's position in its sequence (``kv_len - q_len + j``).
        decode_only: every sequence has exactly one new token (the decode wrapper serves it).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    batch_indices: torch.Tensor
    positions: torch.Tensor
    decode_only: bool


def plan_arguments(meta: AttentionMetadata) -> FlashInferPlan:
    """FlashInfer's plan and append arguments for ``meta`` (what ``get_batch_indices_positions``
    computes on the GPU with Triton, here in plain torch so it is testable anywhere)."""
    q_lens = meta.q_lens()
    batch_indices = torch.repeat_interleave(torch.arange(meta.num_seqs), q_lens)
    int32 = torch.int32
    return FlashInferPlan(
        qo_indptr=meta.qo_indptr.to(int32),
        kv_indptr=meta.kv_indptr.to(int32),
        kv_indices=meta.kv_indices.to(int32),
        kv_last_page_len=meta.kv_last_page_len.to(int32),
        batch_indices=batch_indices.to(int32),
        positions=meta.positions().to(int32),
        decode_only=bool((q_lens == 1).all()),
    )


class FlashInferAttention:
    """Paged attention with FlashInfer kernels; see :class:`~specroll.engine.attention.AttentionBackend`.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads (``num_heads`` is a multiple).
        head_dim: 64, 128 or 256 (FlashInfer's FA2 head dims).
        device: the CUDA device of the model and KV cache.
        dtype: q and KV-cache dtype (bfloat16 or float16; FlashInfer has no float32 attention).
        kernel_backend: FlashInfer's prefill backend: ``fa2`` (default: one kernel family to
            JIT-compile; verify batches with ≤ 64 query rows run FA2 under ``auto`` anyway) or
            ``auto`` (FA3 for long prefills on Hopper).

    Raises:
        ValueError: the device is not CUDA, the dtype is not 16-bit, the head size is not compiled,
            or the package is missing or does not import.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        kernel_backend: str = "fa2",
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA device, got {device}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the flashinfer backend runs bfloat16 or float16, got {dtype}; use dtype 'auto'")
        if head_dim not in (64, 128, 256):
            raise ValueError(f"the flashinfer backend supports head_dim 64, 128 or 256; got {head_dim}")
        try:
            import flashinfer
        except Exception as exc:
            raise ValueError(f"the flashinfer backend needs a flashinfer package that imports "
                             f"(pip install -e '.[cuda]'); {type(exc).__name__}: {exc}") from exc
        self._flashinfer = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device, self.dtype = device, dtype
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # decode wants it zeroed
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=kernel_backend)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads not in _DECODE_GROUP_SIZES
        )
        self._wrapper: object = self._prefill
        self._append: tuple[torch.Tensor, ...] = ()

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan the step's kernels (host work, once per step) and stage the append indices."""
        args = plan_arguments(meta)
        to_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        kv_indices = to_device(args.kv_indices)
        self._append = (
            to_device(args.batch_indices), to_device(args.positions), kv_indices,
            to_device(args.kv_indptr), to_device(args.kv_last_page_len),
        )
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.head_dim**-0.5)
        if args.decode_only:
            # indptr and last_page_len stay on the CPU: plan() reads them on the host.
            self._decode.plan(args.kv_indptr, kv_indices, args.kv_last_page_len, self.num_heads,
                              self.num_kv_heads, self.head_dim, meta.page_size, **common)
            self._wrapper = self._decode
        else:
            self._prefill.plan(args.qo_indptr, args.kv_indptr, kv_indices, args.kv_last_page_len, self.num_heads,
                               self.num_kv_heads, self.head_dim, meta.page_size, causal=True, **common)
            self._wrapper = self._prefill

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        batch_indices, positions, kv_indices, kv_indptr, last_page_len = self._append
        # The append kernel reinterprets K/V as the cache dtype without checking: cast first.
        self._flashinfer.append_paged_kv_cache(
            k.to(kv_cache.dtype), v.to(kv_cache.dtype), batch_indices, positions, kv_cache,
            kv_indices, kv_indptr, last_page_len, kv_layout="NHD",
        )
        return self._wrapper.run(q.to(self.dtype).contiguous(), kv_cache)  # type: ignore[attr-defined]
