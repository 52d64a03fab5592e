"""Trainer checkpoints in ``RUN_DIR/checkpoint/``: weights, AdamW state and progress, without pickle.

Layout (every file is safetensors or JSON, so loading a checkpoint can never run code):

* ``model.safetensors`` — the policy under Hugging Face names (``CausalLM.hf_weights``), loadable
  with ``CausalLM.load_weights`` or ``Engine.update_weights``;
* ``optimizer.safetensors`` — AdamW's per-parameter state, ``"{parameter}/{key}"`` → tensor, keys
  ``exp_avg``, ``exp_avg_sq``, ``step`` (and ``max_exp_avg_sq`` with amsgrad), under the model's own
  (fused) parameter names; hyperparameters come from the config on load;
* ``trainer_state.json`` — :class:`TrainerState`: step, policy version, prompt cursor, seed;
* ``checksums.json`` — every file's size and SHA-256 (``engine/loaders/sealed.py``).

The files hold full tensors whatever the number of trainer ranks: a sharded trainer gathers them
on rank 0 to write them (``sharded.py``) and restores by broadcasting them from rank 0, so a
checkpoint written by N ranks resumes with M.

A checkpoint is a sealed folder: written into a staging folder beside it, every file fsynced and
hashed, then swapped in with two renames; the checkpoint before it is kept as ``checkpoint.prev/``
(so two are on disk, never more). A SIGKILL or a full disk in the middle of a write leaves the
checkpoints there before it as they were. A resume (:func:`read_newest_checkpoint`) reads
``checkpoint/`` and, when a file of it is missing, cut short or changed (its checksum), falls back
to ``checkpoint.prev/``. A checkpoint written before checksums (no ``checksums.json``) loads
unchecked, as it did then.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specroll.engine.loaders.checkpoint import CheckpointError, check_weights
from specroll.engine.loaders.sealed import CHECKSUMS_FILE, Newest, check_folder, read_newest, write_folder
from specroll.engine.loaders.tensor_files import save_tensors
from specroll.engine.model import CausalLM
from specroll.engine.model_config import ModelConfig

log = logging.getLogger("specroll.trainer")

CHECKPOINT_DIRNAME = "checkpoint"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
FORMAT = 1
"""Version of this layout, stored in ``trainer_state.json``."""

T = TypeVar("T")


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


def checkpoint_dir(run_dir: str | Path) -> Path:
    """``run_dir/checkpoint``: the newest checkpoint (the one before it: ``checkpoint.prev``)."""
    return Path(run_dir) / CHECKPOINT_DIRNAME


def read_newest_checkpoint(run_dir: str | Path, read: Callable[[Path], T]) -> Newest[T]:
    """``read`` (a :func:`read_checkpoint` or :func:`load_trainer_checkpoint` of one folder) the
    newest checkpoint of ``run_dir`` whose files pass their checksums: ``checkpoint/``, else
    ``checkpoint.prev/``. ``Newest.refused`` holds the :class:`ChecksumError` (or, for a folder
    without checksums, the :class:`CheckpointError`: a file cut short, another model's shapes) of each
    folder passed over; ``Newest.path`` is None when none was read (none there, or every one refused).
    """
    # A folder without checksums.json (written before them, or by hand) is read unchecked: a file of it
    # cut short fails to load (CheckpointError), and is refused as a checksum failure would be.
    return read_newest(checkpoint_dir(run_dir), read, refuse=(CheckpointError,))  # ChecksumError is one


def save_checkpoint(run_dir: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer,
                    state: TrainerState) -> Path:
    """Write ``run_dir/checkpoint/`` of an unsharded ``model`` and its ``optimizer`` (see
    :func:`write_checkpoint`); returns its path.

    Raises:
        OSError: the files cannot be written (the checkpoints before are left in place; a full disk:
            ``errno`` in ``sealed.OUT_OF_SPACE``).
    """
    return write_checkpoint(run_dir, model.hf_weights(), optimizer_tensors(model, optimizer), state)


def write_checkpoint(run_dir: str | Path, weights: Mapping[str, torch.Tensor],
                     optimizer: Mapping[str, torch.Tensor], state: TrainerState) -> Path:
    """Write ``run_dir/checkpoint/`` atomically (see the module docstring); returns its path.

    Args:
        weights: the policy under Hugging Face names (full tensors: gathered, when it is sharded).
        optimizer: AdamW's state, ``"{parameter}/{key}"`` → full tensor, under the model's own
            parameter names (:func:`optimizer_tensors`, or a gathered full optimizer state dict).
        state: the trainer's progress.

    Raises:
        OSError: the files cannot be written (the checkpoints before are left in place; a full disk:
            ``errno`` in ``sealed.OUT_OF_SPACE``).
    """

    def write_files(folder: Path) -> None:
        # contiguous copies: safetensors refuses tensors that share storage (the fused q/k/v slices)
        save_tensors(_copies(weights), folder / MODEL_FILE, metadata={"format": "pt"})
        save_tensors(_copies(optimizer), folder / OPTIMIZER_FILE)
        record = {"format": FORMAT, **asdict(state)}
        (folder / STATE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    return write_folder(checkpoint_dir(run_dir), write_files, keep_previous=True)


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint as read and checked by :func:`read_checkpoint` (full tensors, on the CPU)."""

    state: TrainerState
    weights: dict[str, torch.Tensor]
    """The policy under Hugging Face names (``CausalLM.load_weights`` takes them)."""
    optimizer: dict[str, dict[str, torch.Tensor]]
    """AdamW's state: parameter name (the model's own, fused) → ``exp_avg``, ``exp_avg_sq``, ``step``..."""


def read_checkpoint(path: str | Path, config: ModelConfig, param_shapes: Mapping[str, torch.Size]) -> SavedCheckpoint:
    """Read and check the checkpoint at ``path`` for a model of ``config`` whose parameters (their
    own names, full shapes: a sharded parameter's global shape) are ``param_shapes``.

    Raises:
        ChecksumError: a file is missing, cut short or changed since it was written (its checksum).
        CheckpointError: a file is missing or unreadable, the weights do not fit the model, the
            optimizer state names an unknown parameter or has a wrong shape, or the state file is
            malformed. The message names the file.
    """
    path = Path(path)
    if not check_folder(path):
        log.warning("%s has no %s: its files are read unchecked (a checkpoint from before checksums, or "
                    "one whose list was removed)", path, CHECKSUMS_FILE)
    state = _read_state(path / STATE_FILE)
    weights = check_weights(config, _read_tensors(path / MODEL_FILE), str(path / MODEL_FILE))
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path / OPTIMIZER_FILE).items():
        name, _, field = key.rpartition("/")
        shape = param_shapes.get(name)
        if shape is None:
            raise CheckpointError(f"{path / OPTIMIZER_FILE}: state for unknown parameter {name!r}")
        if field != "step" and tensor.shape != shape:
            raise CheckpointError(f"{path / OPTIMIZER_FILE}: {key} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(shape)}")
        per_param.setdefault(name, {})[field] = tensor
    return SavedCheckpoint(state, dict(weights), per_param)


def load_trainer_checkpoint(path: str | Path, model: CausalLM, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore an unsharded ``model`` and its ``optimizer`` (built from the same config as when
    saved, by any number of ranks) from ``path``.

    Raises:
        CheckpointError: as :func:`read_checkpoint`.
    """
    params = dict(model.named_parameters())
    saved = read_checkpoint(path, model.config, {name: p.shape for name, p in params.items()})
    model.load_weights(saved.weights)
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for name, fields in saved.optimizer.items():
        if id(params[name]) not in index:
            raise CheckpointError(f"{Path(path) / OPTIMIZER_FILE}: state for parameter {name!r}, which the "
                                  "optimizer does not train")
        per_param[index[id(params[name])]] = fields
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": per_param, "param_groups": current["param_groups"]})
    return saved.state


def optimizer_tensors(model: CausalLM, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's state of an unsharded model as saved: ``"{parameter}/{key}"`` → tensor (views).

    Raises:
        TypeError: a state value that is not a tensor (only tensors are saved).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {key!r} of {names[id(param)]} is a {type(value).__name__}, "
                                "expected a tensor (only tensors are saved)")
            out[f"{names[id(param)]}/{key}"] = value.detach()
    return out


def _copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies that share no storage (what ``safetensors.save_file`` takes)."""
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}


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

