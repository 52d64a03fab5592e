"""Tiny random-weight checkpoints written the way Hugging Face writes them, and teacher forcing."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_model import CHAT_TEMPLATE, TINY_VOCAB, write_tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "TINY_VOCAB", "TOKEN_A", "TOKEN_B", "hf_tiny_config", "reveal_weights",
           "teacher_forced_logits", "write_tiny_checkpoint", "write_tiny_tokenizer"]

TOKEN_A, TOKEN_B = 100, 200
"""Under :func:`reveal_weights`' weights A greedy decoding emits only TOKEN_A; under weights B only TOKEN_B."""


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


def reveal_weights(path: Path) -> dict[str, torch.Tensor]:
    """Make the checkpoint at ``path`` emit only TOKEN_A whatever the context (weights A) and
    return the LM head of weights B (only TOKEN_B).

    Attention and MLP outputs are zeroed and every token embeds to the same vector v, so the final
    hidden state is norm(v) at every position; an LM head with one row ∝ v then makes that row's
    token the argmax. So the token a step emits names the weights its forward pass used.
    """
    weights = load_file(path / "model.safetensors")
    for name, t in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    v = torch.randn(weights["model.embed_tokens.weight"].shape[1], generator=torch.Generator().manual_seed(0))
    weights["model.embed_tokens.weight"][:] = v

    def head(token: int) -> torch.Tensor:
        h = torch.zeros_like(weights["lm_head.weight"])  # [V, hidden]
        h[token] = 10 * v / v.norm()
        return h

    weights["lm_head.weight"] = head(TOKEN_A)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return {"lm_head.weight": head(TOKEN_B)}
