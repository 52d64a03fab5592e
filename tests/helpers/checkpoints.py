"""Tiny random-weight checkpoints written the way Hugging Face writes them, and teacher forcing."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_model import CHAT_TEMPLATE, TINY_VOCAB, write_tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "TINY_VOCAB", "hf_tiny_config", "teacher_forced_logits", "write_tiny_checkpoint",
           "write_tiny_tokenizer"]


def hf_tiny_config(arch: str, **overrides: object):
    """A transformers config for a tiny Llama / Qwen2 / Qwen3."""
    import transformers

    kw: dict[str, object] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=arch == "llama", eos_token_id=2, bos_token_id=None, rope_theta=10000.0,
    )
    if arch == "qwen3":
        kw["head_dim"] = 32
    kw.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    return cls[arch](**kw)


def write_tiny_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides: object):
    """Save a random-weight model (and tokenizer) to ``path``; return the transformers model."""
    import transformers

    torch.manual_seed(seed)
    config = hf_tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all near-uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return model


def teacher_forced_logits(engine, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float32 ``[len(response), V]``: ``engine``'s model logits predicting each response token,
    from one prefill of prompt + response on scratch pages 0..7 of its KV cache."""
    from specroll.engine.batch import build_metadata

    ids = torch.tensor(prompt + response)
    meta = build_metadata([len(ids)], [len(ids)], [list(range(8))], engine.config.page_size)
    engine.backend.plan(meta)
    hidden, _ = engine.model(ids, meta.positions(), engine.kv_caches, engine.backend)
    return engine.model.compute_logits(hidden)[len(prompt) - 1 : -1]
