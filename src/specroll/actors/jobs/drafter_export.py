"""``specroll drafter export`` / ``import``: an ``eagle3`` drafter to and from the EAGLE-3 checkpoint
vLLM and SGLang load (the format is in ``specroll.drafter.eagle3_format``).

Export writes the folder whole or not at all, with ``checksums.json`` (``engine/loaders/sealed.py``;
vLLM and SGLang ignore it, ``drafter import`` checks it): into a staging folder beside ``--out``,
renamed onto it at the end (``--out`` may be missing or an empty directory). The target's config (``--model``,
its metadata only) checks that the drafter was made for it and gives ``max_position_embeddings``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specroll.actors.jobs.generate import GenerateError
from specroll.drafter.eagle3_format import eagle3_config, eagle3_tensors, read_eagle3
from specroll.drafter.eagle_config import DrafterError
from specroll.drafter.eagle_files import CONFIG_FILE, WEIGHTS_FILE
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.loaders.checkpoint import CheckpointError, load_model_config
from specroll.engine.loaders.sealed import write_folder
from specroll.engine.loaders.tensor_files import save_tensors
from specroll.engine.model_config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _target(model: str) -> ModelConfig:
    try:
        return load_model_config(model)
    except CheckpointError as exc:
        raise GenerateError(f"--model {exc}") from None


def _check_out(out: Path, what: str) -> None:
    """``--out`` must be a new path or an empty directory."""
    if not str(out).strip():
        raise GenerateError(f"--out is empty; expected a new directory to write the {what} into")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise GenerateError(f"--out {out} exists and is not a directory; expected a new or empty directory")
        if any(out.iterdir()):
            raise GenerateError(f"--out {out} is a non-empty directory; expected a new or empty directory "
                                "(nothing is overwritten)")


def run_drafter_export(args: argparse.Namespace) -> None:
    """Write the ``eagle3`` drafter in ``args.drafter`` as an EAGLE-3 checkpoint to ``args.out``.

    Raises:
        GenerateError: a missing or malformed drafter, an ``eagle`` one or one whose taps the format
            cannot hold (the message says why), a drafter made for another model, a bad ``--out``
            (a file, a non-empty directory, an unwritable place); nothing is left behind then.
    """
    out = Path(args.out)
    _check_out(out, "checkpoint")
    try:
        head = EagleHead.load(args.drafter)
    except DrafterError as exc:
        raise GenerateError(str(exc)) from None
    target = _target(args.model)
    dtype = DTYPES[args.dtype]
    try:
        config = eagle3_config(head, target, dtype)  # refuses what the format cannot hold, saying why
    except DrafterError as exc:
        raise GenerateError(f"cannot export {args.drafter} for {args.model}: {exc}") from None
    tensors = eagle3_tensors(head, dtype)

    def write_files(folder: Path) -> None:
        save_tensors(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GenerateError(f"cannot write to {parent}: {exc.strerror or exc}") from None
    try:
        write_folder(out, write_files)
    except OSError as exc:
        raise GenerateError(f"cannot write the checkpoint to {out}: {exc.strerror or exc}") from None
    size = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    print(f"EAGLE-3 checkpoint of {args.drafter} ({len(tensors)} tensors, {size:.1f} MiB {args.dtype}, taps "
          f"{config['eagle_aux_hidden_state_layer_ids']}, draft vocabulary {config['draft_vocab_size']} of "
          f"{config['vocab_size']}) -> {out}")


def run_drafter_import(args: argparse.Namespace) -> None:
    """Read the EAGLE-3 checkpoint ``args.checkpoint`` for ``args.model`` and save it as a specroll
    drafter to ``args.out`` (to serve, or to warm-start training from).

    Raises:
        GenerateError: a missing or malformed checkpoint, one made for another model, a bad ``--out``
            (a file, a non-empty directory: nothing is overwritten or mixed, an unwritable place).
    """
    out = Path(args.out)
    _check_out(out, "drafter")
    if not Path(args.checkpoint).is_dir():
        raise GenerateError(f"{args.checkpoint}: not a directory; expected an EAGLE-3 checkpoint folder "
                            "(config.json + model.safetensors)")
    target = _target(args.model)
    try:
        head = read_eagle3(args.checkpoint, target)
    except DrafterError as exc:
        raise GenerateError(str(exc)) from None
    try:
        head.save(out)
    except OSError as exc:
        raise GenerateError(f"cannot write the drafter to {out}: {exc.strerror or exc}") from None
    print(f"eagle3 drafter from {args.checkpoint} (taps {list(head.config.feature_layers)}, draft vocabulary "
          f"{head.config.draft_vocab_size}) -> {out}")
