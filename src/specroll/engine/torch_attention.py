"""Reference paged attention in plain torch: the CPU backend and the correctness oracle.

``plan`` turns FlashInfer's batch description into gather indices once per step; ``forward``
then, for each layer, scatters the new K/V into the pages and runs
``scaled_dot_product_attention`` on K/V gathered from them. A batch whose sequences all have the
same few new tokens (every decode step, and every verify step with k drafts each) takes two
batched matmuls on whole pages gathered in the batch's order, with no reordering of rows. Otherwise decodes
share one batched call and sequences with a few new tokens (speculative verifies) another, padded
to their longest query; long prefills run one by one so that a long prompt never pads the whole
batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specroll.engine.batch import AttentionMetadata, dense_mask

SHORT_QUERY = 32
"""Sequences with at most this many new tokens share one padded attention call."""


@dataclass(frozen=True)
class _PaddedGroup:
    rows: torch.Tensor  # [S, q_max] int64: token row of each (sequence, query) slot
    valid: torch.Tensor  # [S, q_max] bool: the slot holds a real query
    page_table: torch.Tensor  # [S, max_pages] int64: each sequence's pages (padded with page 0)
    mask: torch.Tensor | None  # [S, 1, q_max, max_pages * page_size] bool, True = attend; None = all


@dataclass(frozen=True)
class _Uniform:
    """Every sequence has ``q_len`` new tokens: rows are ``[B, q_len]`` in batch order."""

    q_len: int
    pages: torch.Tensor  # [B * max_pages] int64: each sequence's pages, padded with page 0
    bias: torch.Tensor  # [B * H_kv, group * q_len or 1, max_pages * page_size] float32: 0 = attend, -inf = not


@dataclass(frozen=True)
class _Prefill:
    rows: slice
    k_slots: torch.Tensor  # [kv_len] int64
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None when q_len == kv_len (plain causal)


def _k_slot(meta: AttentionMetadata, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Flat K index of token ``pos`` of sequence ``seq`` in a cache viewed as ``[-1, H_kv, D]``."""
    ps = meta.page_size
    page = meta.kv_indices.long()[meta.kv_indptr.long()[seq] + torch.div(pos, ps, rounding_mode="floor")]
    return page * (2 * ps) + pos % ps


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class TorchAttention:
    """Paged attention with torch ops; see :class:`~specroll.engine.attention.AttentionBackend`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self._cache_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def plan(self, meta: AttentionMetadata, graph: tuple[int, int] | None = None) -> None:
        """Gather indices for ``meta`` (``graph`` is ignored: this backend is never captured; its
        graph steps run eagerly over the padded batch)."""
        ps = self.page_size = meta.page_size
        q_lens, kv_lens = meta.q_lens(), meta.kv_lens()
        positions, seq_of_row = meta.positions(), meta.batch_indices()  # [T], [T]
        k_slots = _k_slot(meta, seq_of_row, positions)  # [T] flat K row of each new token (its V row is ps later)
        self.k_slots, self.v_slots = k_slots.to(self.device), (k_slots + ps).to(self.device)
        self.num_tokens = meta.num_tokens
        q_list, kv_list = meta.lengths()
        self.uniform: _Uniform | None = None
        if max(q_list) <= SHORT_QUERY and min(q_list) == max(q_list):
            self.uniform = self._plan_uniform(meta, q_list[0], kv_list)
            return
        self.short: list[tuple[_PaddedGroup, torch.Tensor]] = []  # (group, its token rows [n])
        for short in ((q_lens == 1).nonzero().flatten(), ((q_lens > 1) & (q_lens <= SHORT_QUERY)).nonzero().flatten()):
            if short.numel():
                group = self._plan_padded(meta, short, q_lens[short], kv_lens[short])
                self.short.append((group, group.rows[group.valid]))
        self.prefills: list[_Prefill] = []
        starts = meta.qo_indptr.tolist()
        for b in (q_lens > SHORT_QUERY).nonzero().flatten().tolist():
            q_len, kv_len = int(q_lens[b]), int(kv_lens[b])
            k_slots = _k_slot(meta, torch.full((kv_len,), b), torch.arange(kv_len))
            tree = None if meta.tree_masks is None else meta.tree_masks.get(b)
            mask = None
            if q_len != kv_len or tree is not None:  # bottom-right causal: row i sees positions <= kv_len - q_len + i
                mask = dense_mask(q_len, kv_len, tree)
            on_device = None if mask is None else mask.to(self.device)
            self.prefills.append(_Prefill(slice(starts[b], starts[b] + q_len), k_slots.to(self.device), on_device))

    def _plan_uniform(self, meta: AttentionMetadata, q_len: int, kv_list: list[int]) -> _Uniform:
        ps, b = meta.page_size, meta.num_seqs
        num_pages = [-(-kv // ps) for kv in kv_list]
        max_pages = max(num_pages)
        starts = meta.kv_indptr.tolist()
        indices = meta.kv_indices.tolist()
        pages = torch.tensor([p for start, n in zip(starts, num_pages, strict=False)  # [B * max_pages], padded
                              for p in (*indices[start : start + n], *[0] * (max_pages - n))], device=self.device)
        kv_cols = max_pages * ps
        # query j of b sees positions <= kv_len - q_len + j (bottom-right causal; never past kv_len)
        last_visible = meta.kv_lens()[:, None] - q_len + torch.arange(q_len)[None, :]  # [B, q_len]
        visible = torch.arange(kv_cols)[None, None, :] <= last_visible[:, :, None]  # [B, q_len, kv_cols]
        for i, tree in (meta.tree_masks or {}).items():  # a tree's nodes see only their ancestors
            visible[i, :, kv_list[i] - tree.shape[1] : kv_list[i]] &= tree
        bias = torch.where(visible, 0.0, float("-inf"))
        # the score rows of one K/V head are (query head of its group, query): the mask repeats per
        # head, or broadcasts over the group's rows when there is one query
        heads_per_kv = self.num_heads // self.num_kv_heads if q_len > 1 else 1
        bias = bias[:, None, None].expand(b, self.num_kv_heads, heads_per_kv, q_len, kv_cols)
        bias = bias.reshape(b * self.num_kv_heads, heads_per_kv * q_len, kv_cols)
        return _Uniform(q_len, pages, bias.to(self.device))

    def _plan_padded(
        self, meta: AttentionMetadata, seqs: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor
    ) -> _PaddedGroup:
        ps = meta.page_size
        q_max = int(q_lens.max())
        j = torch.arange(q_max)[None, :]  # [1, q_max]
        valid = j < q_lens[:, None]  # [S, q_max]
        rows = meta.qo_indptr.long()[seqs][:, None] + torch.where(valid, j, 0)
        # Whole pages are gathered (one block copy per page, not one per token); columns past a
        # sequence's length are masked.
        num_pages = (meta.kv_indptr[1:] - meta.kv_indptr[:-1]).long()[seqs]  # [S]
        pi = torch.arange(int(num_pages.max()))[None, :]  # [1, max_pages]
        in_table = pi < num_pages[:, None]
        start = meta.kv_indptr.long()[seqs][:, None]
        page_table = torch.where(in_table, meta.kv_indices.long()[start + torch.where(in_table, pi, 0)], 0)
        kv_cols = pi.shape[1] * ps
        p = torch.arange(kv_cols)[None, :]  # [1, kv_cols]
        mask = None
        if q_max > 1 or bool((kv_lens != kv_cols).any()):
            last_visible = (kv_lens - q_lens)[:, None, None] + j[:, :, None]  # [S, q_max, 1]
            mask = ((p < kv_lens[:, None])[:, None, :] & (p[:, None, :] <= last_visible))[:, None]
            if meta.tree_masks:
                for s, b in enumerate(seqs.tolist()):
                    tree = meta.tree_masks.get(b)
                    if tree is not None:  # a tree's nodes see only their ancestors
                        end = int(kv_lens[s])
                        mask[s, 0, : tree.shape[0], end - tree.shape[1] : end] &= tree
        to = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        return _PaddedGroup(to(rows), to(valid), to(page_table), to(mask))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        ps = self.page_size
        flat, k_pages, v_pages = self._views(kv_cache)
        flat.index_copy_(0, self.k_slots, k if k.dtype == flat.dtype else k.to(flat.dtype))
        flat.index_copy_(0, self.v_slots, v if v.dtype == flat.dtype else v.to(flat.dtype))
        if self.uniform is not None:
            return self._forward_uniform(q, k_pages, v_pages, self.uniform)
        # The attention maths runs in float32: torch's CPU kernels for bf16/fp16 with a mask are
        # several times slower, and the gathered copies are made anyway.
        qf = q.float()
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # [T, H, D]
        for g, rows in self.short:
            qg = qf[g.rows].transpose(1, 2)  # [S, H, q_max, D]
            pages = kv_cache[g.page_table]  # [S, max_pages, 2, ps, H_kv, D]
            s_, n = pages.shape[:2]
            kg = pages[:, :, 0].float().reshape(s_, n * ps, self.num_kv_heads, self.head_dim).transpose(1, 2)
            vg = pages[:, :, 1].float().reshape(s_, n * ps, self.num_kv_heads, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale, enable_gqa=True)
            out[rows] = o.transpose(1, 2)[g.valid]
        for p in self.prefills:
            qp = qf[p.rows].transpose(0, 1)  # [H, q_len, D]
            kp = flat[p.k_slots].float().transpose(0, 1)  # [H_kv, kv_len, D]
            vp = flat[p.k_slots + ps].float().transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale, enable_gqa=True
            )
            out[p.rows] = o.transpose(0, 1)
        return out.to(q.dtype)

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``kv_cache`` as ``[P·2·ps, H_kv, D]`` rows and its K and V pages ``[P, ps, H_kv, D]``; made
        once per cache (keyed by its address, which the views keep from being reused)."""
        views = self._cache_views.get(kv_cache.data_ptr())
        if views is None:
            flat = kv_cache.view(-1, self.num_kv_heads, self.head_dim)
            views = self._cache_views[kv_cache.data_ptr()] = (flat, kv_cache[:, 0], kv_cache[:, 1])
        return views

    def _forward_uniform(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: _Uniform
    ) -> torch.Tensor:
        """Attention when every sequence has ``plan.q_len`` new tokens (every decode step, every
        verify of k drafts each): softmax(q·Kᵀ·scale + bias)·V as two batched matmuls per K/V head,
        the query heads of a K/V head (GQA) stacked as the rows of one matrix, on whole pages
        gathered in batch order; float32 maths, as the general path. On these shapes torch's CPU
        flash kernel (``scaled_dot_product_attention``) is 1.3-2.5x slower from 4 sequences up, and
        3-5x on verifies.
        """
        b, q_len, hkv, d = q.shape[0] // plan.q_len, plan.q_len, self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        kv_cols = plan.pages.numel() // b * self.page_size
        # [B * max_pages, ps, H_kv, D] → [B * H_kv, kv_cols, D] (a view when H_kv = 1)
        k = k_pages.index_select(0, plan.pages).view(b, kv_cols, hkv, d).transpose(1, 2).reshape(b * hkv, kv_cols, d)
        v = v_pages.index_select(0, plan.pages).view(b, kv_cols, hkv, d).transpose(1, 2).reshape(b * hkv, kv_cols, d)
        # queries of K/V head j: heads j·group .. (j+1)·group − 1, each at its q_len rows
        if q_len == 1:
            qg = q.reshape(b * hkv, group, d)  # [T, H, D] → [B·H_kv, group, D]
        else:
            qg = q.view(b, q_len, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, group * q_len, d)
        scores = torch.baddbmm(plan.bias, _float32(qg), _float32(k).transpose(1, 2), alpha=self.scale)
        o = torch.bmm(scores.softmax(-1), _float32(v))  # [B·H_kv, group·q_len, D]
        if q_len == 1:
            o = o.view(q.shape)
        else:
            o = o.view(b, hkv, group, q_len, d).permute(0, 3, 1, 2, 4).reshape(q.shape)  # [T, H, D]
        return o if o.dtype == q.dtype else o.to(q.dtype)
