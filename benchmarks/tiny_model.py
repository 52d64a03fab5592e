"""A tiny random-weight Llama checkpoint directory, written the way Hugging Face lays one out
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat
template), from specroll's own dependencies only (``safetensors``, ``tokenizers``): benchmarks that
exercise the actors rather than the model (``bench_chaos.py``) run on it, and the tests' fixtures
(``tests/helpers/checkpoints.py``) take its tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specroll.engine.model_config import ModelConfig, expected_weight_shapes

TINY_VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(path: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` (+ ``tokenizer_config.json``) with ``TINY_VOCAB`` tokens;
    token 2 (``<|im_end|>``) ends a turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many in May."] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
    ))


def write_tiny_llama(path: Path, seed: int = 0, std: float = 0.2) -> Path:
    """Write a 2-layer, 64-wide Llama with random weights (matrices N(0, ``std``): wide enough that
    its next-token distributions are far from uniform) and the tiny tokenizer to ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    config = ModelConfig(architecture="llama", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_ids=(2,))
    generator = torch.Generator().manual_seed(seed)
    weights = {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * std
               for name, shape in expected_weight_shapes(config).items()}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": True, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32",
    }, indent=1))
    write_tiny_tokenizer(path)
    return path
