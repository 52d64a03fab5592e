"""Logits parity with Hugging Face transformers on tiny random Llama, Qwen2 and Qwen3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from specroll.engine.attention import allocate_kv_cache
from specroll.engine.batch import build_metadata
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.engine.torch_attention import TorchAttention


def engine_model(path):
    ckpt = load_checkpoint(path)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    return model.eval(), ckpt.config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_prefill_and_decode_logits_match_transformers(tiny_checkpoint, arch, tied):
    path = tiny_checkpoint(arch, tie_word_embeddings=tied)
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    model, config = engine_model(path)
    ids = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]  # [45, V]

    page_size, table = 8, [11, 3, 7, 0, 5, 9]  # pages need not be contiguous or ordered
    caches = allocate_kv_cache(config, 12, page_size, torch.float32, "cpu")
    backend = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim)
    got = []
    prefill = 29
    meta = build_metadata([prefill], [prefill], [table], page_size)
    backend.plan(meta)
    got.append(model.compute_logits(model(ids[:prefill], meta.positions(), caches, backend)[0]))
    for t in range(prefill, len(ids)):  # step-by-step decode, crossing page boundaries
        meta = build_metadata([1], [t + 1], [table], page_size)
        backend.plan(meta)
        got.append(model.compute_logits(model(ids[t : t + 1], meta.positions(), caches, backend)[0]))
    diff = (torch.cat(got) - expected).abs().max().item()
    assert diff <= 1e-4, f"{arch}: max |logits - transformers| = {diff}"
