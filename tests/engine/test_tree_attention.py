"""Tree attention in the torch backend: each draft-tree row attends to the cached context and to its
ancestors only, as a dense softmax over those positions does."""

from __future__ import annotations

import pytest
import torch


def random_tree_mask(q_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.eye(q_len, dtype=torch.bool)
    for i in range(1, q_len):
        mask[i] |= mask[int(torch.randint(i, (1,), generator=g))]
    return mask


@pytest.mark.parametrize("q_lens", [[9, 9, 9], [9, 1, 40, 5], [40, 3]], ids=["uniform", "padded", "long tree"])
def test_torch_tree_attention_equals_dense_attention_over_ancestors(q_lens):
    from specroll.engine.batch import build_metadata, dense_mask
    from specroll.engine.torch_attention import TorchAttention

    h, h_kv, d, ps = 4, 2, 16, 8
    kv_lens = [q + extra for q, extra in zip(q_lens, [13, 30, 7, 22], strict=False)]
    masks = {b: random_tree_mask(q, b) for b, q in enumerate(q_lens) if q > 1 and not (q == 40 and b == 2)}
    tables, page = [], 0
    for kv in kv_lens:
        n = -(-kv // ps)
        tables.append(list(range(page + n - 1, page - 1, -1)))  # pages in reverse: gathers must follow the table
        page += n
    meta = build_metadata(q_lens, kv_lens, tables, ps, masks)
    torch.manual_seed(0)
    cache = torch.randn(page, 2, ps, h_kv, d)
    t = sum(q_lens)
    q, k, v = torch.randn(t, h, d), torch.randn(t, h_kv, d), torch.randn(t, h_kv, d)
    backend = TorchAttention(h, h_kv, d)
    backend.plan(meta)
    out = backend.forward(q, k, v, cache)
    row = 0
    for b, (q_len, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        keys = torch.cat([cache[p, 0] for p in tables[b]])[:kv]  # [kv, H_kv, D], the appended rows included
        values = torch.cat([cache[p, 1] for p in tables[b]])[:kv]
        visible = dense_mask(q_len, kv, masks.get(b))  # [q_len, kv]
        for j in range(q_len):
            for head in range(h):
                kh = keys[:, head // (h // h_kv)]
                scores = (kh @ q[row + j, head]) / d**0.5
                scores[~visible[j]] = float("-inf")
                expected = scores.softmax(-1) @ values[:, head // (h // h_kv)]
                torch.testing.assert_close(out[row + j, head], expected, atol=1e-5, rtol=1e-5)
        row += q_len
