"""Paged attention equals dense attention: the torch backend against an explicit causal softmax.

Each case writes a K/V history into a paged cache filled with noise, runs one ragged step through
``build_metadata`` + ``TorchAttention`` (which appends the step's new K/V and attends), and checks
every sequence's output against a float64 dense reference over its whole history with the
bottom-right causal mask: query row i of a sequence with q new tokens and K/V length L sees the
positions ≤ L − q + i. Noise in the unused slots makes any read past a sequence's K/V show.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specroll.engine.batch import AttentionMetadata, build_metadata
from specroll.engine.torch_attention import SHORT_QUERY, TorchAttention

HEAD_DIM = 16
TOL = 1e-5


@dataclass
class Seq:
    q_len: int
    k: torch.Tensor  # [L, H_kv, D] the whole K history after this step's append
    v: torch.Tensor  # [L, H_kv, D]
    table: list[int]
    written_from: int = 0
    """History positions below this are already in the cache (a shared prefix written by another)."""

    @property
    def kv_len(self) -> int:
        return self.k.shape[0]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 reference: ``q`` ``[q, H, D]`` attends to ``k``/``v`` ``[L, H_kv, D]`` bottom-right causally.

    Query head h reads K/V head ``h // (H / H_kv)`` (Hugging Face's ``repeat_kv``).
    """
    q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * head_dim**-0.5  # [H, q, L]
    visible = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]  # [q, L]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [q, H, D]


def random_seq(gen: torch.Generator, q_len: int, kv_len: int, table: list[int], num_kv_heads: int) -> Seq:
    k = torch.randn(kv_len, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(kv_len, num_kv_heads, HEAD_DIM, generator=gen)
    return Seq(q_len, k, v, table)


def run_step(
    seqs: list[Seq], num_heads: int, num_kv_heads: int, page_size: int, num_pages: int, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Write each history's old part into a noisy cache, run one step; return (outputs, queries,
    cache before the step, cache after it)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_pages, 2, page_size, num_kv_heads, HEAD_DIM, generator=gen)  # [P, 2, ps, H_kv, D]
    for s in seqs:
        for pos in range(s.written_from, s.kv_len - s.q_len):
            page, slot = s.table[pos // page_size], pos % page_size
            cache[page, 0, slot], cache[page, 1, slot] = s.k[pos], s.v[pos]
    before = cache.clone()
    queries = [torch.randn(s.q_len, num_heads, HEAD_DIM, generator=gen) for s in seqs]
    meta = build_metadata([s.q_len for s in seqs], [s.kv_len for s in seqs], [s.table for s in seqs], page_size)
    backend = TorchAttention(num_heads, num_kv_heads, HEAD_DIM)
    backend.plan(meta)
    out = backend.forward(
        torch.cat(queries),
        torch.cat([s.k[s.kv_len - s.q_len :] for s in seqs]),
        torch.cat([s.v[s.kv_len - s.q_len :] for s in seqs]),
        cache,
    )  # [T, H, D]
    assert out.shape == (meta.num_tokens, num_heads, HEAD_DIM) and out.dtype == torch.float32
    return list(out.split([s.q_len for s in seqs])), queries, before, cache


def check_step(seqs: list[Seq], num_heads: int, num_kv_heads: int, page_size: int, num_pages: int) -> None:
    outputs, queries, before, after = run_step(seqs, num_heads, num_kv_heads, page_size, num_pages)
    for b, (s, out, q) in enumerate(zip(seqs, outputs, queries, strict=True)):
        expected = dense_attention(q, s.k, s.v)
        diff = (out.double() - expected).abs().max().item()
        assert diff <= TOL, f"sequence {b} (q_len={s.q_len}, kv_len={s.kv_len}): max |paged - dense| = {diff}"
    # The step appended exactly the new K/V: every history slot holds its token, every other slot
    # (other pages, the tails of last pages) keeps what it had.
    expected_cache = before.clone()
    for s in seqs:
        for pos in range(s.kv_len):
            page, slot = s.table[pos // page_size], pos % page_size
            expected_cache[page, 0, slot], expected_cache[page, 1, slot] = s.k[pos], s.v[pos]
    assert torch.equal(after, expected_cache)


def shuffled_tables(gen: torch.Generator, kv_lens: list[int], page_size: int, spare: int = 5) -> tuple[list, int]:
    """Disjoint block tables of shuffled page ids, with ``spare`` unused pages mixed in."""
    needed = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(needed) + spare
    pool = torch.randperm(num_pages, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start : start + n])
        start += n
    return tables, num_pages


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (9, 3)])
def test_ragged_mixed_batch_equals_dense(num_heads: int, num_kv_heads: int) -> None:
    page_size = 8
    # (q_len, kv_len): full prefills (plain causal), prefill chunks after cached tokens (q < L, some
    # above SHORT_QUERY), decodes at several lengths, and speculative verifies of 2..9 tokens.
    shapes = [
        (40, 40), (1, 13), (SHORT_QUERY + 1, SHORT_QUERY + 1), (5, 21), (1, 1), (23, 35), (9, 30), (1, 64),
        (2, 8), (SHORT_QUERY, 50), (3, 3), (SHORT_QUERY + 1, 57), (7, 16), (1, 9), (4, 33),
    ]
    gen = torch.Generator().manual_seed(num_heads)
    tables, num_pages = shuffled_tables(gen, [kv for _, kv in shapes], page_size)
    seqs = [random_seq(gen, q, kv, t, num_kv_heads) for (q, kv), t in zip(shapes, tables, strict=True)]
    check_step(seqs, num_heads, num_kv_heads, page_size, num_pages)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("phase", ["prefill", "decode", "verify"])
def test_lengths_at_page_boundaries(page_size: int, phase: str) -> None:
    # K/V lengths page_size*m - j for j = 0..3 (j = 0: exactly m full pages), m = 1..3.
    kv_lens = [page_size * m - j for m in (1, 2, 3) for j in range(4) if page_size * m - j > 0]
    q_of = {"prefill": lambda n: n, "decode": lambda n: 1, "verify": lambda n: min(n, 5)}[phase]
    gen = torch.Generator().manual_seed(page_size)
    tables, num_pages = shuffled_tables(gen, kv_lens, page_size)
    seqs = [random_seq(gen, q_of(n), n, t, 3) for n, t in zip(kv_lens, tables, strict=True)]
    check_step(seqs, 6, 3, page_size, num_pages)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("q_len", [1, 5])
def test_uniform_batches_equal_dense(num_heads: int, num_kv_heads: int, q_len: int) -> None:
    # Every sequence with the same q_len (a decode step, a verify step with k drafts each) takes
    # the one-call path; lengths around page boundaries and one sequence a single page long.
    page_size = 4
    kv_lens = [q_len, 7, 8, 9, 16, 17, 30]
    gen = torch.Generator().manual_seed(num_heads * 10 + q_len)
    tables, num_pages = shuffled_tables(gen, kv_lens, page_size)
    seqs = [random_seq(gen, q_len, n, t, num_kv_heads) for n, t in zip(kv_lens, tables, strict=True)]
    check_step(seqs, num_heads, num_kv_heads, page_size, num_pages)


def test_block_tables_may_be_longer_than_needed() -> None:
    # A table holds pages reserved for tokens not yet computed; only ceil(L / page_size) are read.
    gen = torch.Generator().manual_seed(5)
    seqs = [random_seq(gen, 3, 10, [6, 1, 4, 9], 2), random_seq(gen, 1, 4, [0, 7, 3], 2)]
    check_step(seqs, 6, 2, 4, 10)


@pytest.mark.parametrize(("tail_a", "q_a", "tail_b", "q_b"), [(5, 5, 3, 3), (7, 1, 2, 2), (20, 20, 1, 1)])
def test_sequences_sharing_prefix_pages(tail_a: int, q_a: int, tail_b: int, q_b: int) -> None:
    # Two samples of one prompt: the prompt's full pages (written once) appear in both block tables;
    # each sequence then owns the pages of its own tail. A third, unrelated sequence sits between.
    page_size, shared_pages = 4, [9, 2, 6]
    shared_len = page_size * len(shared_pages)
    gen = torch.Generator().manual_seed(tail_a)
    prefix_k = torch.randn(shared_len, 2, HEAD_DIM, generator=gen)
    prefix_v = torch.randn(shared_len, 2, HEAD_DIM, generator=gen)

    def sibling(tail: int, q_len: int, own_pages: list[int], written_from: int) -> Seq:
        s = random_seq(gen, q_len, tail, [], 2)
        return Seq(q_len, torch.cat([prefix_k, s.k]), torch.cat([prefix_v, s.v]), shared_pages + own_pages,
                   written_from)

    a = sibling(tail_a, q_a, [0, 11, 3, 13, 8][: -(-tail_a // page_size)], 0)
    b = sibling(tail_b, q_b, [5], shared_len)  # the shared pages are already in the cache
    other = random_seq(gen, 2, 6, [1, 12], 2)
    check_step([a, other, b], 6, 2, page_size, 14)


def test_metadata_follows_flashinfer_page_table_layout() -> None:
    # FlashInfer "Page Table Layout": sequence b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]],
    # its K/V length is (num_pages - 1) * page_size + kv_last_page_len[b], and its new tokens are the
    # last q_len of those: rows qo_indptr[b]:qo_indptr[b+1] at positions kv_len - q_len + j.
    meta = AttentionMetadata(
        qo_indptr=torch.tensor([0, 3, 4, 6], dtype=torch.int32),
        kv_indptr=torch.tensor([0, 1, 3, 6], dtype=torch.int32),
        kv_indices=torch.tensor([7, 2, 5, 0, 9, 4], dtype=torch.int32),
        kv_last_page_len=torch.tensor([3, 2, 4], dtype=torch.int32),
        page_size=4,
    )
    assert meta.num_seqs == 3 and meta.num_tokens == 6
    assert meta.q_lens().tolist() == [3, 1, 2]
    assert meta.kv_lens().tolist() == [3, 6, 12]
    assert meta.positions().tolist() == [0, 1, 2, 5, 10, 11]
    assert meta.kv_lens().dtype == meta.positions().dtype == torch.int64


def test_build_metadata_describes_the_batch() -> None:
    meta = build_metadata([3, 1, 2], [3, 6, 12], [[7, 8], [2, 5], [0, 9, 4, 1]], page_size=4)
    assert meta.qo_indptr.tolist() == [0, 3, 4, 6]
    assert meta.kv_indptr.tolist() == [0, 1, 3, 6]
    assert meta.kv_indices.tolist() == [7, 2, 5, 0, 9, 4]  # unused table entries are dropped
    assert meta.kv_last_page_len.tolist() == [3, 2, 4]
    assert meta.page_size == 4
    for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len):
        assert t.dtype == torch.int32


@pytest.mark.parametrize(("q_lens", "kv_lens", "tables", "match"), [
    ([5], [4], [[0, 1]], "q_len=5, kv_len=4"),
    ([0], [4], [[0]], "q_len=0"),
    ([1], [9], [[0, 1]], "kv_len=9 with 2 pages of 4"),
    ([1, 2], [4, 5], [[0], [1]], "kv_len=5 with 1 pages of 4"),
    ([1, 1], [4], [[0]], "2 q_lens, 1 kv_lens, 1 block tables"),
])
def test_build_metadata_rejects_bad_input(q_lens, kv_lens, tables, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_metadata(q_lens, kv_lens, tables, page_size=4)
