"""The EAGLE-3 checkpoint vLLM and SGLang load, from and to an ``eagle3`` :class:`EagleHead`.

A folder with ``config.json`` and ``model.safetensors``. Tensors (``H`` hidden size, ``I`` MLP
width, ``H_q``/``H_kv`` heads of ``D``, ``V`` target vocabulary, ``N`` draft vocabulary):

    fc.weight                                  [H, 3H]        fusion of the low/mid/high taps
    midlayer.input_layernorm.weight            [H]            on the token embedding
    midlayer.hidden_norm.weight                [H]            on the feature
    midlayer.self_attn.q_proj.weight           [H_q·D, 2H]    reads [embedding ; feature]
    midlayer.self_attn.k_proj.weight           [H_kv·D, 2H]
    midlayer.self_attn.v_proj.weight           [H_kv·D, 2H]
    midlayer.self_attn.o_proj.weight           [H, H_q·D]
    midlayer.post_attention_layernorm.weight   [H]
    midlayer.mlp.gate_proj.weight              [I, H]
    midlayer.mlp.up_proj.weight                [I, H]
    midlayer.mlp.down_proj.weight              [H, I]
    norm.weight                                [H]
    lm_head.weight                             [N, H]
    d2t                                        int64 [N]      target_id = draft_id + d2t[draft_id]
    t2d                                        bool  [V]      target token is in the draft vocabulary

(SafeAILab/EAGLE ``eagle/traineagle3/cnets.py`` — ``midlayer``, ``fc``, ``norm``, ``lm_head`` and the
``d2t``/``t2d`` buffers of ``scandata``; NVIDIA ModelOpt's ``LLAMA_EAGLE_SINGLE_LAYER`` lists the same
required names with ``d2t`` and ``lm_head.weight``; vLLM ``llama_eagle3.py`` renames ``midlayer.`` to
``layers.0.``, loads ``d2t`` as ``draft_id_to_target_id`` and skips ``t2d``; SGLang turns ``d2t``
into ``hot_token_id`` and skips ``t2d``.) There is no ``embed_tokens.weight``: the embedding is the
target's, and both engines take it from the target when the file has none (vLLM shares it unless
``has_own_embed_tokens``; SGLang's EAGLE-3 worker always calls ``set_embed``).

``config.json`` is a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
``num_hidden_layers: 1``, ``vocab_size = V``, ``draft_vocab_size = N``, ``tie_word_embeddings:
false`` (SGLang then builds its own ``lm_head`` of ``N`` rows) and the taps. The two engines read
the tap ids with different meanings, so both keys are written:

* top-level ``eagle_aux_hidden_state_layer_ids`` — vLLM (read first, ``gpu_model_runner.py``
  ``_get_eagle3_aux_layers_from_config``): id ``i`` is the hidden state *entering* layer ``i``
  (``llama.py``: ``aux_hidden_states.append(hidden_states + residual)`` before layer ``idx``), the
  taps of :meth:`CausalLM.forward` as they are;
* ``eagle_config.eagle_aux_hidden_state_layer_ids`` — SGLang (``model_runner.py``), whose
  ``set_eagle3_layers_to_capture`` captures before layer ``id + 1``: the taps minus one.

Only an ``eagle3`` head with three taps entering target layers fits (vLLM's ``fc`` is ``3H`` wide).
Import (:func:`read_eagle3`) accepts such a folder from any trainer: ``midlayer.`` or ``layers.0.``
names, ``d2t`` optional (absent: the whole vocabulary), tap ids from the top-level key, else
``eagle_config``'s plus one, else EAGLE-3's default ``(2, N//2, N−3)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import torch

from specroll.drafter.eagle_config import DrafterError, EagleConfig
from specroll.drafter.eagle_files import CONFIG_FILE, WEIGHTS_FILE
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.loaders.errors import ChecksumError
from specroll.engine.loaders.sealed import check_folder
from specroll.engine.model_config import ModelConfig

ARCHITECTURE_NAME = "LlamaForCausalLMEagle3"
"""``architectures[0]`` of an EAGLE-3 head (vLLM's registry maps it to ``Eagle3LlamaForCausalLM``)."""
EAGLE3_ARCHITECTURES = (ARCHITECTURE_NAME, "Eagle3LlamaForCausalLM")
"""Names an imported config may carry."""
NUM_TAPS = 3

_LAYER = {  # EAGLE-3 name under ``midlayer.`` → (specroll parameter, part of a fused one: index, or None)
    "input_layernorm.weight": ("layer.input_layernorm.weight", None),
    "hidden_norm.weight": ("layer.hidden_norm.weight", None),
    "self_attn.q_proj.weight": ("layer.self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("layer.self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("layer.self_attn.qkv_proj.weight", 2),
    "self_attn.o_proj.weight": ("layer.self_attn.o_proj.weight", None),
    "post_attention_layernorm.weight": ("layer.post_attention_layernorm.weight", None),
    "mlp.gate_proj.weight": ("layer.mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("layer.mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("layer.mlp.down_proj.weight", None),
}
_TOP = ("fc.weight", "norm.weight", "lm_head.weight")


def exportable(head: EagleHead, target: ModelConfig) -> None:
    """Raise :class:`DrafterError` (saying why) unless ``head`` can be written as an EAGLE-3
    checkpoint for ``target``: an ``eagle3`` head made for it, with three taps entering its layers."""
    config = head.config
    if config.architecture != "eagle3":
        raise DrafterError(
            f"the drafter is an {config.architecture!r} head (fc over [embedding; feature], then a standard "
            "decoder layer, through the target's LM head); the EAGLE-3 format vLLM and SGLang load has q/k/v "
            "reading [embedding; feature] and the head's own LM head, so it cannot hold this one; make an "
            "eagle3 drafter ('specroll init-drafter --architecture eagle3', 'specroll drafter train "
            "--architecture eagle3') and train it")
    config.check_target(target)
    taps = list(config.feature_layers)
    if len(taps) != NUM_TAPS or not all(0 <= i < target.num_layers for i in taps):
        raise DrafterError(
            f"the drafter taps target layers {taps}; the EAGLE-3 format needs {NUM_TAPS} hidden states entering "
            f"target layers (ids in [0, {target.num_layers})), as vLLM's fc is 3·hidden_size wide")


def eagle3_config(head: EagleHead, target: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``head`` as an EAGLE-3 checkpoint (module docstring) for ``target``,
    with weights of ``dtype``.

    Raises:
        DrafterError: ``head`` is not :func:`exportable`.
    """
    exportable(head, target)
    c = head.config
    taps = list(c.feature_layers)
    return {
        "architectures": [ARCHITECTURE_NAME],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": c.target_vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": taps,  # vLLM: the state entering layer i
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps],  # SGLang captures before layer id + 1
        },
    }


def eagle3_tensors(head: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``head``'s tensors under the EAGLE-3 names (module docstring): weights of ``dtype``, int64
    ``d2t`` offsets, bool ``t2d``; CPU, contiguous. The head must be :func:`exportable`."""
    c = head.config
    own = {name: t.detach().to("cpu", torch.float32) for name, t in head.state_dict().items()}
    splits = {"layer.self_attn.qkv_proj.weight": [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                                   c.num_kv_heads * c.head_dim],
              "layer.mlp.gate_up_proj.weight": [c.intermediate_size, c.intermediate_size]}
    out = {name: own[name] for name in _TOP}
    for name, (param, part) in _LAYER.items():
        tensor = own[param] if part is None else own[param].split(splits[param])[part]
        out[f"midlayer.{name}"] = tensor
    out = {name: t.to(dtype).contiguous() for name, t in out.items()}
    d2t = head.draft_to_target.to("cpu", torch.int64)
    out["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()  # target_id = draft_id + d2t[draft_id]
    t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    out["t2d"] = t2d
    return out


def read_eagle3(path: str | Path, target: ModelConfig) -> EagleHead:
    """An ``eagle3`` :class:`EagleHead` (float32) from an EAGLE-3 checkpoint folder for ``target``.

    Raises:
        DrafterError: a missing or unreadable file, one that fails the folder's ``checksums.json``
            (when it has one: ``specroll drafter export`` writes it), a config that is not a one-layer
            EAGLE-3 head of ``target``'s vocabulary and width, or tensors missing or of the wrong
            shape; the message names the file and the value.
    """
    path = Path(path)
    try:
        check_folder(path)
    except ChecksumError as exc:
        raise DrafterError(f"EAGLE-3 checkpoint {exc}") from None
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    for p in (config_path, weights_path):
        if not p.is_file():
            raise DrafterError(f"EAGLE-3 checkpoint {path}: {p.name} not found; expected {CONFIG_FILE} and "
                               f"{WEIGHTS_FILE} as 'specroll drafter export' writes them")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DrafterError(f"EAGLE-3 checkpoint {config_path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise DrafterError(f"EAGLE-3 checkpoint {config_path}: expected a JSON object")
    config = _head_config(raw, target, str(config_path))
    try:
        with safetensors.safe_open(str(weights_path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, safetensors.SafetensorError) as exc:
        raise DrafterError(f"EAGLE-3 checkpoint {weights_path}: not a readable safetensors file ({exc})") from None
    return EagleHead.from_tensors(config, _own_tensors(config, tensors, str(weights_path)),
                                  f"EAGLE-3 checkpoint {weights_path}")


def _head_config(raw: Mapping[str, Any], target: ModelConfig, where: str) -> EagleConfig:
    def field(key: str, default: Any = None) -> Any:
        value = raw.get(key, default)
        if value is None:
            raise DrafterError(f"EAGLE-3 checkpoint {where}: '{key}' missing")
        return value

    arch = (raw.get("architectures") or [None])[0]
    if arch not in EAGLE3_ARCHITECTURES:
        raise DrafterError(f"EAGLE-3 checkpoint {where}: architectures={raw.get('architectures')}, expected "
                           f"[{ARCHITECTURE_NAME!r}]")
    eagle = raw.get("eagle_config") or {}
    checks = {"num_hidden_layers": (field("num_hidden_layers"), 1),
              "hidden_size": (field("hidden_size"), target.hidden_size),
              "target_hidden_size": (raw.get("target_hidden_size", target.hidden_size), target.hidden_size),
              "vocab_size": (field("vocab_size"), target.vocab_size),
              "eagle_config.use_aux_hidden_state": (eagle.get("use_aux_hidden_state", True), True),
              "norm_before_residual": (raw.get("norm_before_residual", False), False),
              "attention_bias": (raw.get("attention_bias", False), False)}
    for key, (value, wanted) in checks.items():
        if value != wanted:
            raise DrafterError(f"EAGLE-3 checkpoint {where}: {key}={value!r}, expected {wanted!r} (a one-layer "
                               f"EAGLE-3 head over this model's taps, hidden size {target.hidden_size} and "
                               f"vocabulary {target.vocab_size})")
    n = target.num_layers
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        taps = _tap_ids(raw["eagle_aux_hidden_state_layer_ids"], "eagle_aux_hidden_state_layer_ids", n, where)
    elif eagle.get("eagle_aux_hidden_state_layer_ids"):
        taps = [i + 1 for i in _tap_ids(eagle["eagle_aux_hidden_state_layer_ids"],
                                        "eagle_config.eagle_aux_hidden_state_layer_ids", n, where, shift=1)]
    else:
        taps = [2, n // 2, n - 3]
    heads = field("num_attention_heads")
    try:
        return EagleConfig(
            target.vocab_size, target.hidden_size, field("intermediate_size"), heads,
            field("num_key_value_heads", heads), field("head_dim", target.hidden_size // heads),
            float(field("rms_norm_eps")), float(field("rope_theta", 10000.0)), tuple(taps),
            field("draft_vocab_size", target.vocab_size), n, architecture="eagle3")
    except (TypeError, ValueError) as exc:
        raise DrafterError(f"EAGLE-3 checkpoint {where}: {exc}") from None


def _tap_ids(value: Any, key: str, num_layers: int, where: str, shift: int = 0) -> list[int]:
    """The checkpoint's ``NUM_TAPS`` tap ids, each ``0 ≤ id + shift < num_layers`` (what
    :func:`exportable` accepts).

    Raises:
        DrafterError: not a list of that many integers in range; the message names the key and value.
    """
    ok = (isinstance(value, list) and len(value) == NUM_TAPS
          and all(type(i) is int and 0 <= i + shift < num_layers for i in value))
    if not ok:
        raise DrafterError(f"EAGLE-3 checkpoint {where}: {key}={value!r}, expected {NUM_TAPS} integer layer ids "
                           f"from {-shift} to {num_layers - 1 - shift} (this model has {num_layers} layers)")
    return list(value)


def _own_tensors(config: EagleConfig, tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """EAGLE-3 names → the head's state dict (shapes are checked by ``EagleHead.from_tensors``)."""
    named = {(k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k): t
             for k, t in tensors.items() if k not in ("t2d", "embed_tokens.weight")}
    wanted = {*_TOP, *(f"midlayer.{k}" for k in _LAYER)}
    missing = sorted(wanted - set(named))
    if missing:
        raise DrafterError(f"EAGLE-3 checkpoint {where}: missing tensors {missing[:4]}")
    out = {name: named[name].float() for name in _TOP}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for name, (param, part) in _LAYER.items():
        if part is None:
            out[param] = named[f"midlayer.{name}"].float()
        else:
            fused.setdefault(param, {})[part] = named[f"midlayer.{name}"].float()
    for param, parts in fused.items():
        widths = {t.shape[1:] for t in parts.values()}
        if len(widths) != 1:
            raise DrafterError(f"EAGLE-3 checkpoint {where}: the parts of {param} differ in width {sorted(widths)}")
        out[param] = torch.cat([parts[i] for i in sorted(parts)])
    n = config.draft_vocab_size
    d2t = named.get("d2t")
    if d2t is None:
        draft_to_target = torch.arange(n)
    elif d2t.is_floating_point() or d2t.dtype == torch.bool or tuple(d2t.shape) != (n,):
        raise DrafterError(f"EAGLE-3 checkpoint {where}: d2t is {d2t.dtype} {tuple(d2t.shape)}, expected int64 "
                           f"offsets ({n},)")
    else:
        draft_to_target = torch.arange(n) + d2t.long()
    order = draft_to_target.argsort()  # a head's ids ascend; its lm_head rows follow them
    if out["lm_head.weight"].shape[0] == n:  # another row count is reported by from_tensors
        out["lm_head.weight"] = out["lm_head.weight"][order]
    out["draft_to_target"] = draft_to_target[order]
    return out
