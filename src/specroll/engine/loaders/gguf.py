"""Load a GGUF file (llama.cpp's format) into a :class:`Checkpoint` with Hugging Face weight names.

Quantized tensors are dequantized to float32 with ``gguf.quants.dequantize`` and then cast, so the
model sees the values llama.cpp would compute with, not the original full-precision weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from specroll.engine.loaders.errors import CheckpointError
from specroll.engine.loaders.tokenizer import Tokenizer
from specroll.engine.model_config import Architecture, ModelConfig

GGUF_ARCHITECTURES: tuple[Architecture, ...] = ("llama", "qwen2", "qwen3")
"""``general.architecture`` values we load."""

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file's metadata, tokenizer and (dequantized) tensors.

    Weights come back under Hugging Face Llama names with Hugging Face shapes ``[out, in]``, cast
    to ``dtype``; for ``llama`` files the Q/K rows llama.cpp permuted are put back in HF order.
    They are not checked against the config here: ``checkpoint.load_checkpoint`` does that (with
    ``check_weights``) for every format alike.

    Raises:
        CheckpointError: the file cannot be parsed as GGUF, or its architecture, tokenizer, RoPE
            scaling or a tensor type is unsupported.
    """
    path = Path(path)
    reader, config, tokenizer = read_gguf(path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        weight = _dequantize(tensor, path)
        name = _hf_name(tensor.name)
        heads = config.num_heads if ".self_attn.q_proj." in name else config.num_kv_heads
        if (
            config.architecture == "llama"
            and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
            and weight.shape[0] == heads * config.head_dim  # else check_weights reports the shape
        ):
            weight = _unpermute_rope_rows(weight, heads)
        weights[name] = weight.to(dtype)
    return config, weights, tokenizer


def read_gguf(path: Path) -> tuple[gguf.GGUFReader, ModelConfig, Tokenizer]:
    """A GGUF file's reader (its tensors not read yet), model config and tokenizer.

    Raises:
        CheckpointError: as :func:`load_gguf`, for the file and its metadata.
    """
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # gguf-py has no error type of its own; any failure here means a bad file
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    tokenizer = Tokenizer.from_gguf(reader)
    config = _config(reader, path, tokenizer)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens, token_embd has {config.vocab_size} rows"
        )
    return reader, config, tokenizer


def _config(reader: gguf.GGUFReader, path: Path, tokenizer: Tokenizer) -> ModelConfig:
    arch = _value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: general.architecture={arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def number(key: str, default: float | None = None) -> Any:
        value = _value(reader, f"{arch}.{key}")
        value = default if value is None else value
        if value is None:
            raise CheckpointError(f"{path}: metadata {arch}.{key} is missing")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{path}: metadata {arch}.{key}={value!r}, expected a number")
        return value

    names = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing")
    if "rope_freqs.weight" in names or _value(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{path}: RoPE scaling (rope_freqs / {arch}.rope.scaling.*) is unsupported")
    if "blk.0.attn_output.bias" in names:
        raise CheckpointError(f"{path}: blk.0.attn_output.bias: an output-projection bias is not supported")
    hidden, heads = int(number("embedding_length")), int(number("attention.head_count"))
    head_dim = int(number("attention.key_length", hidden // max(heads, 1)))
    rope_dims = int(number("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise CheckpointError(
            f"{path}: {arch}.rope.dimension_count={rope_dims}, expected head_dim={head_dim} (no partial RoPE)"
        )
    try:
        return ModelConfig(
            architecture=arch,
            # GGUF dims are innermost first: token_embd is [hidden, vocab].
            vocab_size=int(names["token_embd.weight"].shape[-1]),
            hidden_size=hidden,
            intermediate_size=int(number("feed_forward_length")),
            num_layers=int(number("block_count")),
            num_heads=heads,
            num_kv_heads=int(number("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=_decimal(number("attention.layer_norm_rms_epsilon")),
            # llama.cpp reads an absent freq_base as 10000, the format's documented default.
            rope_theta=_decimal(number("rope.freq_base", 10000.0)),
            max_position_embeddings=int(number("context_length")),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm=arch == "qwen3",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
        )
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _dequantize(tensor: gguf.ReaderTensor, path: Path) -> torch.Tensor:
    """The tensor as float32 in HF (row-major, outermost first) shape."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    try:
        # A plain ndarray view: numpy.memmap slicing overhead would double the dequantize time.
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from exc
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:  # an F32 tensor is a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values)


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``).

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)…, HF rotates halves (x_i, x_{i+d/2}).
    The converter reorders each head's rows as ``w.reshape(h, 2, d/2, …).swapaxes(1, 2)``, i.e.
    HF row ``j*d/2 + i`` (half j, index i) goes to row ``2i + j``; the inverse reads the rows as
    ``[h, d/2, 2, …]`` and swaps back. Works for the weight ``[h*d, in]`` and the bias ``[h*d]``.
    """
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])  # [h, d/2, 2, ...]
    return pairs.transpose(1, 2).reshape(weight.shape)  # [h, 2, d/2, ...] flattened: halves again


def _hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor; unknown names come back unchanged (then reported as unexpected)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match[2] in _BLOCK_NAMES:
        return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"
    return gguf_name


def _decimal(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; recover the shortest
    decimal that rounds to the same float32 (1e-05), i.e. the value the config was written with."""
    return float(str(np.float32(value)))


def _value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()
