"""Load a checkpoint — a registered name, a Hugging Face directory or a GGUF file — into a
:class:`ModelConfig`, weights under Hugging Face Llama names, and a :class:`Tokenizer`.

Every problem with the files on disk is reported as a :class:`CheckpointError` that names the file
or field and what was expected; nothing here guesses past a bad checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specroll.engine.loaders.errors import CheckpointError
from specroll.engine.loaders.gguf import load_gguf, read_gguf
from specroll.engine.loaders.registry import resolve_model
from specroll.engine.loaders.tokenizer import Tokenizer
from specroll.engine.model_config import Architecture, ModelConfig, expected_weight_shapes


@dataclass(frozen=True)
class Checkpoint:
    """Everything needed to build a model and talk to it."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    """Hugging Face Llama names → tensors with the shapes of :func:`expected_weight_shapes`."""
    tokenizer: Tokenizer
    source: str
    """The file or directory the checkpoint was read from."""


HF_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""config.json ``architectures[0]`` values we load, and the family each maps to."""


def load_checkpoint(model: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load ``model``: a registered name (see ``registry.py``), a Hugging Face checkpoint directory
    (config.json, model.safetensors or a sharded index, tokenizer.json) or a ``.gguf`` file.

    Floating-point weights are cast to ``dtype``; integer tensors keep their dtype.

    Raises:
        CheckpointError: the path does not exist, is neither a directory with config.json nor a
            .gguf file, or anything in it is malformed or unsupported.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}, expected a floating-point torch dtype")
    path = resolve_model(str(model))
    if path.is_file() and path.suffix == ".gguf":
        config, weights, tokenizer = load_gguf(path, dtype)
        return Checkpoint(config, check_weights(config, weights, str(path)), tokenizer, str(path))
    if path.is_dir():
        return _load_hf_dir(path, dtype)
    raise CheckpointError(f"{path}: expected a Hugging Face checkpoint directory or a .gguf file")


def load_metadata(model: str | Path) -> tuple[ModelConfig, Tokenizer]:
    """The :class:`ModelConfig` and tokenizer of ``model`` without its weights (a server in front of
    generators needs no weights of its own).

    Raises:
        CheckpointError: as :func:`load_checkpoint`, for the path and the metadata.
    """
    path = resolve_model(str(model))
    if path.is_file() and path.suffix == ".gguf":
        _, config, tokenizer = read_gguf(path)
        return config, tokenizer
    if path.is_dir():
        return _read_hf_config(path)
    raise CheckpointError(f"{path}: expected a Hugging Face checkpoint directory or a .gguf file")


def load_model_config(model: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of ``model`` (as :func:`load_checkpoint` takes it), read from its
    metadata without its weights: what a check before any process starts needs.

    Raises:
        CheckpointError: as :func:`load_checkpoint`, for the path and the metadata.
    """
    path = resolve_model(str(model))
    if path.is_file() and path.suffix == ".gguf":
        return read_gguf(path)[1]
    if path.is_dir():
        return _read_hf_config(path)[0]
    raise CheckpointError(f"{path}: expected a Hugging Face checkpoint directory or a .gguf file")


def random_checkpoint(config: ModelConfig, seed: int = 0, std: float = 0.02) -> Checkpoint:
    """A random-weight checkpoint of any shape, with :meth:`Tokenizer.byte_level`: for tests and
    benchmarks at real model shapes without the files (e.g. SmolLM2-135M's on a GPU machine).

    Matrices are drawn from N(0, ``std``) (float32, seeded); norm weights are 1 and biases 0.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * std
    return Checkpoint(config, weights, Tokenizer.byte_level(), f"random(seed={seed})")


def check_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """The tensors of ``weights`` that ``config`` needs, in :func:`expected_weight_shapes` order.

    Drops RoPE ``inv_freq`` buffers and, with tied embeddings, ``lm_head.weight``.

    Raises:
        CheckpointError: naming every missing tensor, unexpected tensor and shape mismatch.
    """
    expected = expected_weight_shapes(config)
    tied_head = "lm_head.weight" if config.tie_word_embeddings else None
    present = {
        name: tensor for name, tensor in weights.items()
        if not name.endswith("rotary_emb.inv_freq") and name != tied_head
    }
    missing = [name for name in expected if name not in present]
    unexpected = [name for name in present if name not in expected]
    mismatched = [
        f"{name} {tuple(present[name].shape)} (expected {shape})"
        for name, shape in expected.items() if name in present and tuple(present[name].shape) != shape
    ]
    problems = [
        f"{label} ({len(names)}): {', '.join(names[:8])}{', …' if len(names) > 8 else ''}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched))
        if names
    ]
    if problems:
        raise CheckpointError(f"{source}: weights do not match the model config; " + "; ".join(problems))
    return {name: present[name] for name in expected}


def _load_hf_dir(path: Path, dtype: torch.dtype) -> Checkpoint:
    config, tokenizer = _read_hf_config(path)
    weights = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in _read_safetensors(path).items()
    }
    return Checkpoint(config, check_weights(config, weights, str(path)), tokenizer, str(path))


def _read_hf_config(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """The model config and tokenizer of a Hugging Face checkpoint directory."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json, expected a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")
    tokenizer = Tokenizer.from_hf_dir(path)
    config = config_from_hf(raw, str(config_file), tokenizer)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens, more than vocab_size={config.vocab_size}"
        )
    return config, tokenizer


def config_from_hf(raw: dict[str, Any], where: str, tokenizer: Tokenizer) -> ModelConfig:
    """A :class:`ModelConfig` from a parsed config.json, with transformers' defaults for absent
    fields (transformers 4 ``rope_theta``/``rope_scaling`` and 5 ``rope_parameters`` both read).

    Raises:
        CheckpointError: an unsupported architecture, activation, RoPE type, sliding window or bias
            layout; a missing or mistyped required field.
    """
    names = raw.get("architectures") or []
    arch_name = names[0] if isinstance(names, list) and names else None
    if arch_name not in HF_ARCHITECTURES:
        raise CheckpointError(
            f"{where}: unsupported architecture {arch_name!r}; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    arch = HF_ARCHITECTURES[arch_name]

    def field(key: str, kind: type, default: Any = None) -> Any:
        value = raw.get(key)
        value = default if value is None else value
        accepted = (float, int) if kind is float else (kind,)  # JSON writes 1e-05 but also 10000
        if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
            raise CheckpointError(f"{where}: {key}={value!r}, expected a {kind.__name__}")
        return kind(value)

    if field("hidden_act", str, "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={raw['hidden_act']!r}, only 'silu' (SwiGLU) is supported")
    if field("mlp_bias", bool, False):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which our model does not have;
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    if arch != "qwen2" and field("attention_bias", bool, False):
        raise CheckpointError(f"{where}: attention_bias=true ({arch} then has an o_proj bias) is unsupported")
    if arch != "llama" and field("use_sliding_window", bool, False):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported")

    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope_parameters={rope!r}, expected an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{where}: rope_type={rope_type!r} is not supported yet; only 'default' RoPE")
    if (partial := rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor={partial}, expected 1.0 (full RoPE)")
    # An absent rope_theta means transformers' default_theta (10000), the documented meaning.
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, int | float):
        raise CheckpointError(f"{where}: rope_theta={rope_theta!r}, expected a number")

    hidden, heads = field("hidden_size", int), field("num_attention_heads", int)
    # transformers' defaults: Qwen3Config.head_dim=128; Llama/Qwen2 derive it from hidden/heads.
    default_head_dim = 128 if arch == "qwen3" else (hidden // heads if heads > 0 else 0)
    bos = tokenizer.bos_token_id
    if bos is None and isinstance(raw.get("bos_token_id"), int):
        bos = raw["bos_token_id"]
    eos = tokenizer.eos_token_ids
    if not eos:
        config_eos = raw.get("eos_token_id")
        eos = (config_eos,) if isinstance(config_eos, int) else tuple(config_eos or ())
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=field("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=field("intermediate_size", int),
            num_layers=field("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=field("num_key_value_heads", int, heads),
            head_dim=field("head_dim", int, default_head_dim),
            rms_norm_eps=field("rms_norm_eps", float, 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=field("max_position_embeddings", int, 2048 if arch == "llama" else 32768),
            tie_word_embeddings=field("tie_word_embeddings", bool, False),
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=bos,
            eos_token_ids=eos,
        )
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards ``model.safetensors.index.json`` names."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: expected a JSON object with a weight_map ({exc!r})") from exc
    else:
        raise CheckpointError(
            f"{path}: no model.safetensors or model.safetensors.index.json "
            "(only safetensors weights are supported)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: weight shard named in {index.name} does not exist")
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    return tensors
