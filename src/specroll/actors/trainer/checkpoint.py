"""Trainer checkpoints in ``RUN_DIR/checkpoint/``: weights, AdamW state and progress, without pickle.

Layout (every file is safetensors or JSON, so loading a checkpoint can never run code):

* ``model.safetensors`` — the policy under Hugging Face names (``CausalLM.hf_weights``), loadable
  with ``CausalLM.load_weights`` or ``Engine.update_weights``;
* ``optimizer.safetensors`` — AdamW's per-parameter state, ``"{parameter}/{key}"`` → tensor, keys
  ``exp_avg``, ``exp_avg_sq``, ``step`` (and ``max_exp_avg_sq`` with amsgrad), under the model's own
  (fused) parameter names; hyperparameters come from the config on load;
* ``trainer_state.json`` — :class:`TrainerState`: step, policy version, prompt cursor, seed.

A checkpoint is written into a temporary directory next to it (files fsynced), then swapped in
with two renames: the old ``checkpoint/`` becomes ``checkpoint.prev/``, the new one takes its name,
the old one is removed. A crash between the renames leaves ``checkpoint.prev/``, which
:func:`find_checkpoint` then uses, so a reader always finds one complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specroll.engine.checkpoint import CheckpointError, check_weights
from specroll.engine.model import CausalLM

CHECKPOINT_DIRNAME = "checkpoint"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
FORMAT = 1
"""Version of this layout, stored in ``trainer_state.json``."""


@dataclass(frozen=True)
class TrainerState:
    """The trainer's progress, as saved with the weights."""

    step: int
    """Optimizer steps taken."""
    policy_version: int
    """Version of the saved weights (published under it)."""
    prompt_cursor: int
    """Prompts submitted so far: the next new group takes prompt number ``prompt_cursor`` of the
    seeded order."""
    seed: int
    """The run seed: with ``prompt_cursor`` it fixes the prompt order and every group's sampling seed."""
    model: str = ""
    """The model the run started from (information only)."""
    untrained: list[int] = field(default_factory=list)
    """Positions (below ``prompt_cursor``) submitted and not yet trained at save time, oldest first:
    a resumed trainer submits them again before new prompts, so no prompt of the order is skipped."""


def find_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of ``run_dir``, or None: ``checkpoint/``, else ``checkpoint.prev/``
    (left by a crash in the middle of the swap)."""
    for name in (CHECKPOINT_DIRNAME, CHECKPOINT_DIRNAME + ".prev"):
        path = Path(run_dir) / name
        if (path / STATE_FILE).is_file():
            return path
    return None


def save_checkpoint(run_dir: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer,
                    state: TrainerState) -> Path:
    """Write ``run_dir/checkpoint/`` atomically (see the module docstring); returns its path.

    Raises:
        OSError: the files cannot be written (the previous checkpoint is left in place).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final, prev = run_dir / CHECKPOINT_DIRNAME, run_dir / (CHECKPOINT_DIRNAME + ".prev")
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".{CHECKPOINT_DIRNAME}.tmp-"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private (0700); a checkpoint is an ordinary directory
        # contiguous copies: safetensors refuses tensors that share storage (the fused q/k/v slices)
        weights = {name: t.detach().to("cpu").contiguous().clone() for name, t in model.hf_weights().items()}
        save_file(weights, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        save_file(_optimizer_tensors(model, optimizer), str(tmp / OPTIMIZER_FILE))
        record = {"format": FORMAT, **asdict(state)}
        (tmp / STATE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        for file in tmp.iterdir():
            _fsync(file)
        _fsync(tmp)
        if prev.exists() and final.exists():
            shutil.rmtree(prev)  # a leftover of an interrupted swap; checkpoint/ is complete
        if final.exists():
            os.rename(final, prev)
        os.rename(tmp, final)
        _fsync(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(prev, ignore_errors=True)
    return final


def load_trainer_checkpoint(path: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore ``model`` and ``optimizer`` (built from the same config as when saved) from ``path``.

    Raises:
        CheckpointError: a file is missing or unreadable, the weights do not fit the model, the
            optimizer state names an unknown parameter or has a wrong shape, or the state file is
            malformed. The message names the file.
    """
    path = Path(path)
    state = _read_state(path / STATE_FILE)
    weights = _read_tensors(path / MODEL_FILE)
    model.load_weights(check_weights(model.config, weights, str(path / MODEL_FILE)))
    tensors = _read_tensors(path / OPTIMIZER_FILE)
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    params = dict(model.named_parameters())
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, field = key.rpartition("/")
        param = params.get(name)
        if param is None or id(param) not in index:
            raise CheckpointError(f"{path / OPTIMIZER_FILE}: state for unknown parameter {name!r}")
        if field != "step" and tensor.shape != param.shape:
            raise CheckpointError(f"{path / OPTIMIZER_FILE}: {key} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(param.shape)}")
        per_param.setdefault(index[id(param)], {})[field] = tensor
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": per_param, "param_groups": current["param_groups"]})
    return state


def _optimizer_tensors(model: CausalLM, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {key!r} of {names[id(param)]} is a {type(value).__name__}, "
                                "expected a tensor (only tensors are saved)")
            out[f"{names[id(param)]}/{key}"] = value.detach().to("cpu").contiguous().clone()
    return out


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def _read_state(file: Path) -> TrainerState:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: cannot read the trainer state ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else raw
        raise CheckpointError(f"{file}: format {got!r}, expected {FORMAT}")
    raw.pop("format")
    try:
        state = TrainerState(**raw)
    except TypeError as exc:
        raise CheckpointError(f"{file}: {exc}") from exc
    for name in ("step", "policy_version", "prompt_cursor", "seed"):
        value = getattr(state, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{file}: {name}={value!r}, expected an integer >= 0")
    untrained = state.untrained
    if not isinstance(untrained, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < state.prompt_cursor for p in untrained):
        raise CheckpointError(f"{file}: untrained={str(untrained)[:80]}, expected a list of integers in "
                              f"[0, prompt_cursor = {state.prompt_cursor})")
    return state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
