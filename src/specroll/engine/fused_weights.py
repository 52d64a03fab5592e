"""Hugging Face's unfused projections against the model's fused parameters: q/k/v stored as one
``qkv_proj`` and gate/up as one ``gate_up_proj`` (one matmul each), mapped by name and row range."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specroll.engine.model_config import ModelConfig, expected_weight_shapes


def _fused_slot(config: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """Where checkpoint tensor ``name`` lives when it is a slice of a fused parameter.

    Returns ``(parameter name, first row, number of rows)``, or None for an unfused tensor.
    """
    prefix, _, leaf = name.rpartition(".")  # leaf: weight / bias
    module_path, _, proj = prefix.rpartition(".")
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    slots = {
        "q_proj": ("qkv_proj", 0, q_size),
        "k_proj": ("qkv_proj", q_size, kv_size),
        "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
        "gate_proj": ("gate_up_proj", 0, config.intermediate_size),
        "up_proj": ("gate_up_proj", config.intermediate_size, config.intermediate_size),
    }
    if proj not in slots:
        return None
    fused, start, rows = slots[proj]
    return f"{module_path}.{fused}.{leaf}", start, rows


def unfuse_weights(config: ModelConfig, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names from the model's own (fused) parameter names: ``params`` is
    ``named_parameters()``-like (e.g. a gathered full state dict of a sharded model); q/k/v and
    gate/up come out as row *views* of the fused tensors. Returns exactly the names of
    ``expected_weight_shapes(config)``, in its order (a tied LM head omitted).

    Raises:
        KeyError: a parameter of ``config``'s architecture is missing from ``params``.
    """
    out: dict[str, torch.Tensor] = {}
    for name in expected_weight_shapes(config):
        slot = _fused_slot(config, name)
        if slot is None:
            out[name] = params[name]
        else:
            fused, start, rows = slot
            out[name] = params[fused][start : start + rows]
    return out


def fuse_weights(config: ModelConfig, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`unfuse_weights`: tensors under Hugging Face names (validated, e.g. by
    ``checkpoint.check_weights``) → new tensors under the model's parameter names, q/k/v and
    gate/up concatenated along rows (what ``set_model_state_dict`` of a sharded model takes).

    Raises:
        KeyError: a slice of a fused parameter is missing (the rows would not be covered).
    """
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in named_tensors.items():
        slot = _fused_slot(config, name)
        if slot is None:
            out[name] = tensor
        else:
            parts.setdefault(slot[0], []).append((slot[1], tensor))
    for fused, pieces in parts.items():
        pieces.sort(key=lambda piece: piece[0])
        expected = 3 if ".qkv_proj." in fused else 2
        if len(pieces) != expected:
            raise KeyError(f"{fused}: {len(pieces)} of its {expected} slices given")
        out[fused] = torch.cat([t for _, t in pieces])
    return out
