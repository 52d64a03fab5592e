"""The description of one forward step: FlashInfer's ragged, paged batch layout.

Every step (prefill chunks, one-token decodes, multi-token verifies) is one ragged batch of B
sequences; sequence b appends ``q_len[b]`` new tokens to a K/V history that then holds
``kv_len[b]`` tokens on the pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``. Every attention
backend consumes exactly this description (FlashInfer docs, "Page Table Layout").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """A ragged batch over a paged KV cache, after the new tokens are appended.

    Attributes:
        qo_indptr: int32 ``[B+1]``; new tokens of sequence b are rows ``qo_indptr[b]:qo_indptr[b+1]``.
        kv_indptr: int32 ``[B+1]``; pages of sequence b are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
        kv_indices: int32 ``[kv_indptr[-1]]``; page ids, concatenated.
        kv_last_page_len: int32 ``[B]``; tokens on each sequence's last page, in ``[1, page_size]``.
        page_size: tokens per page.

    The derived views (:meth:`q_lens`, :meth:`positions`, ...) are computed from these once, or
    handed in by :func:`build_metadata`, which has them as Python lists already: a step's metadata
    costs a few tensor constructions, not a few dozen small tensor ops.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    _lists: _Lists | None = field(default=None, compare=False, repr=False)
    _cache: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    tree_masks: dict[int, torch.Tensor] | None = field(default=None, compare=False)
    """Sequences whose new tokens attend as a tree (``spec/tree.py``): sequence b → bool
    ``[q_len, M]``, which of the last M K/V positions each of its new tokens sees (the positions
    before those it sees all, as the causal mask lets it). ``None``: every sequence is causal."""

    @property
    def num_seqs(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    def lengths(self) -> tuple[list[int], list[int]]:
        """``(q_lens, kv_lens)`` as Python lists (no tensor read when built by :func:`build_metadata`)."""
        lists = self._lists
        if lists is None:
            lists = _Lists(self.q_lens().tolist(), self.kv_lens().tolist())
            object.__setattr__(self, "_lists", lists)
        return lists.q_lens, lists.kv_lens

    def q_lens(self) -> torch.Tensor:
        """int64 ``[B]``: new tokens per sequence."""
        return self._derived("q_lens", lambda: (self.qo_indptr[1:] - self.qo_indptr[:-1]).long())

    def kv_lens(self) -> torch.Tensor:
        """int64 ``[B]``: K/V length per sequence after the append."""
        def compute() -> torch.Tensor:
            num_pages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
            return (num_pages - 1) * self.page_size + self.kv_last_page_len.long()
        return self._derived("kv_lens", compute)

    def batch_indices(self) -> torch.Tensor:
        """int64 ``[T]``: the sequence of each new token."""
        return self._derived("batch_indices",
                             lambda: torch.repeat_interleave(torch.arange(self.num_seqs), self.q_lens()))

    def positions(self) -> torch.Tensor:
        """int64 ``[T]``: position of each new token (row j of b is ``kv_len - q_len + j``)."""
        def compute() -> torch.Tensor:
            seq_of_row = self.batch_indices()
            row_in_seq = torch.arange(self.num_tokens) - self.qo_indptr[:-1].long()[seq_of_row]
            return (self.kv_lens() - self.q_lens())[seq_of_row] + row_in_seq
        return self._derived("positions", compute)

    def _derived(self, name: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        value = self._cache.get(name)
        if value is None:
            value = self._cache[name] = compute()
        return value


@dataclass(frozen=True)
class _Lists:
    q_lens: list[int]
    kv_lens: list[int]


def build_metadata(
    q_lens: Sequence[int], kv_lens: Sequence[int], block_tables: Sequence[Sequence[int]], page_size: int,
    tree_masks: dict[int, torch.Tensor] | None = None,
) -> AttentionMetadata:
    """Describe a batch in FlashInfer's form.

    Args:
        q_lens: new tokens per sequence (≥ 1).
        kv_lens: K/V length per sequence after the append (≥ q_len).
        block_tables: each sequence's pages; only the first ``ceil(kv_len / page_size)`` are used.
        page_size: tokens per page.
        tree_masks: see :attr:`AttentionMetadata.tree_masks`.

    Raises:
        ValueError: when lengths disagree, a block table is too short or a tree mask does not fit
            its sequence.
    """
    if not len(q_lens) == len(kv_lens) == len(block_tables):
        raise ValueError(f"{len(q_lens)} q_lens, {len(kv_lens)} kv_lens, {len(block_tables)} block tables")
    qo_indptr, kv_indptr, indices, last, positions, batch = [0], [0], [], [], [], []
    for b, (q_len, kv_len, table) in enumerate(zip(q_lens, kv_lens, block_tables, strict=True)):
        num_pages = -(-kv_len // page_size)
        if not 1 <= q_len <= kv_len or num_pages > len(table):
            raise ValueError(f"q_len={q_len}, kv_len={kv_len} with {len(table)} pages of {page_size}")
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        indices.extend(table[:num_pages])
        last.append(kv_len - (num_pages - 1) * page_size)
        positions.extend(range(kv_len - q_len, kv_len))
        batch.extend([b] * q_len)
    as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    lists = _Lists(list(q_lens), list(kv_lens))
    cache = {"q_lens": torch.tensor(lists.q_lens), "kv_lens": torch.tensor(lists.kv_lens),
             "positions": torch.tensor(positions), "batch_indices": torch.tensor(batch)}
    for b, mask in (tree_masks or {}).items():
        if not (0 <= b < len(q_lens) and mask.dtype == torch.bool and mask.dim() == 2
                and mask.shape[0] == q_lens[b] and q_lens[b] <= mask.shape[1] <= kv_lens[b]):
            raise ValueError(f"tree mask of sequence {b}: {mask.dtype} {tuple(mask.shape)}, expected bool "
                             f"[q_len, M] with q_len <= M <= kv_len")
    return AttentionMetadata(as_int32(qo_indptr), as_int32(kv_indptr), as_int32(indices), as_int32(last), page_size,
                             lists, cache, tree_masks or None)


def dense_mask(q_len: int, kv_len: int, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[q_len, kv_len]``, True = attend: the bottom-right causal mask (row j sees positions
    ≤ ``kv_len − q_len + j``), and within the last M columns only what ``tree_mask`` ``[q_len, M]``
    lets each row see (:attr:`AttentionMetadata.tree_masks`)."""
    mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    if tree_mask is not None:
        mask[:, kv_len - tree_mask.shape[1]:] &= tree_mask
    return mask
