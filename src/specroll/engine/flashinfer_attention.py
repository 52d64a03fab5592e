"""Paged attention through FlashInfer on CUDA: the generator's fast backend.

One step is planned once (:func:`plan_arguments` builds FlashInfer's arguments from the engine's
:class:`~specroll.engine.batch.AttentionMetadata`, a pure function tested on CPU) and run once per
layer: ``append_paged_kv_cache`` writes the step's new K/V into the pages, then a
``BatchDecodeWithPagedKVCacheWrapper`` (every sequence has one new token) or a
``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (prefill chunks, speculative verifies
of k + 1 tokens, mixed batches), or with a custom mask when the batch verifies draft trees, attends,
with the mask aligned bottom-right as the torch reference does.
FlashInfer docs: "KV-Cache Layout in FlashInfer" and the wrappers' docstrings (flashinfer-python
0.6.18–0.7.x); the traps are listed in the team's FlashInfer notes.

``flashinfer`` is imported only when a backend is built, so this module imports on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specroll.engine.batch import AttentionMetadata, dense_mask

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


def tree_custom_mask(meta: AttentionMetadata) -> torch.Tensor | None:
    """FlashInfer's ``custom_mask`` for a batch with tree sequences (``meta.tree_masks``), else None.

    bool, flat: per sequence its ``[q_len, kv_len]`` mask row-major (query-major), sequences
    concatenated (FlashInfer docs "Mask Layout"; with a custom mask ``causal`` is ignored, so every
    sequence's causal mask is spelled out and tree sequences see only their ancestors)."""
    if not meta.tree_masks:
        return None
    q_lens, kv_lens = meta.lengths()
    return torch.cat([dense_mask(q, kv, meta.tree_masks.get(b)).flatten()
                      for b, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True))])


@dataclass(frozen=True)
class _GraphWrapper:
    """One CUDA-graph bucket's wrapper and the fixed device buffers its captured kernels read."""

    run: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper or BatchPrefillWithPagedKVCacheWrapper
    kv_indptr: torch.Tensor  # int32 [bucket + 1]
    kv_indices: torch.Tensor  # int32 [bucket * max_pages_per_seq]
    kv_last_page_len: torch.Tensor  # int32 [bucket]
    batch_indices: torch.Tensor  # int32 [bucket * q_len]
    positions: torch.Tensor  # int32 [bucket * q_len]


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
        self._workspace, self._kernel_backend = workspace, kernel_backend
        self._tensor_core_decode = num_heads // num_kv_heads not in _DECODE_GROUP_SIZES
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=kernel_backend)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self._tensor_core_decode
        )
        self._wrapper: object = self._prefill
        self._append: tuple[torch.Tensor, ...] = ()
        self._graph_pages_per_seq = 0
        self._graph_wrappers: dict[tuple[int, int], _GraphWrapper] = {}

    def enable_graphs(self, max_pages_per_seq: int) -> None:
        """Serve CUDA-graph steps (``plan(meta, graph)``): their fixed page-table buffers hold
        ``max_pages_per_seq`` pages per sequence of a bucket."""
        self._graph_pages_per_seq = max_pages_per_seq

    def plan(self, meta: AttentionMetadata, graph: tuple[int, int] | None = None) -> None:
        """Plan the step's kernels (host work, once per step) and stage the append indices.

        Args:
            meta: the step's batch.
            graph: ``(bucket, q_len)`` of a CUDA-graph step (``meta`` padded to ``bucket`` sequences of
                ``q_len`` tokens): the step then runs on that bucket's wrapper, whose buffers keep
                fixed addresses, planned here before every replay (FlashInfer's CUDA-graph mode).
        """
        args = plan_arguments(meta)
        if graph is not None:
            self._plan_graph(args, meta.page_size, graph)
            return
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
            mask = tree_custom_mask(meta)
            self._prefill.plan(args.qo_indptr, args.kv_indptr, kv_indices, args.kv_last_page_len, self.num_heads,
                               self.num_kv_heads, self.head_dim, meta.page_size, causal=mask is None,
                               custom_mask=None if mask is None else mask.to(self.device), **common)
            self._wrapper = self._prefill

    def _plan_graph(self, args: FlashInferPlan, page_size: int, key: tuple[int, int]) -> None:
        bucket, q_len = key
        assert self._graph_pages_per_seq > 0, "enable_graphs() first"
        wrapper = self._graph_wrappers.get(key)
        if wrapper is None:
            wrapper = self._graph_wrappers[key] = self._make_graph_wrapper(bucket, q_len)
        if args.kv_indices.numel() > wrapper.kv_indices.numel():
            raise ValueError(f"a graph step of {bucket} sequences uses {args.kv_indices.numel()} pages, more than "
                             f"the {wrapper.kv_indices.numel()} its buffers hold")
        wrapper.batch_indices.copy_(args.batch_indices, non_blocking=True)
        wrapper.positions.copy_(args.positions, non_blocking=True)
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.head_dim**-0.5)
        # plan() copies the page table into the wrapper's fixed buffers, which the append reads too
        if q_len == 1:
            wrapper.run.plan(args.kv_indptr, args.kv_indices, args.kv_last_page_len, self.num_heads,
                             self.num_kv_heads, self.head_dim, page_size, **common)
        else:
            wrapper.run.plan(args.qo_indptr, args.kv_indptr, args.kv_indices, args.kv_last_page_len,
                             self.num_heads, self.num_kv_heads, self.head_dim, page_size, causal=True, **common)
        self._wrapper = wrapper.run
        self._append = (wrapper.batch_indices, wrapper.positions, wrapper.kv_indices, wrapper.kv_indptr,
                        wrapper.kv_last_page_len)

    def _make_graph_wrapper(self, bucket: int, q_len: int) -> _GraphWrapper:
        """A wrapper in CUDA-graph mode for ``bucket`` sequences of ``q_len`` tokens, with its buffers
        (the team's FlashInfer notes, "CUDA graphs with the FlashInfer wrappers")."""
        int32 = dict(dtype=torch.int32, device=self.device)
        kv_indptr, kv_last = torch.zeros(bucket + 1, **int32), torch.zeros(bucket, **int32)
        kv_indices = torch.zeros(bucket * self._graph_pages_per_seq, **int32)
        if q_len == 1:
            run: object = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_core_decode,
                paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=kv_last,
            )
        else:
            qo_indptr = torch.arange(bucket + 1, **int32) * q_len
            run = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_indptr, paged_kv_indptr_buf=kv_indptr,
                paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=kv_last, backend=self._kernel_backend,
            )
        rows = torch.zeros(bucket * q_len, **int32)
        return _GraphWrapper(run, kv_indptr, kv_indices, kv_last, rows, rows.clone())

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        batch_indices, positions, kv_indices, kv_indptr, last_page_len = self._append
        # The append kernel reinterprets K/V as the cache dtype without checking: cast first. K and
        # V are views of the fused q/k/v output with different strides: give it contiguous rows.
        self._flashinfer.append_paged_kv_cache(
            k.to(kv_cache.dtype).contiguous(), v.to(kv_cache.dtype).contiguous(), batch_indices, positions, kv_cache,
            kv_indices, kv_indptr, last_page_len, kv_layout="NHD",
        )
        return self._wrapper.run(q.to(self.dtype).contiguous(), kv_cache)  # type: ignore[attr-defined]
