"""A drafter on disk: a sealed folder (``engine/loaders/sealed.py``: written whole or not at all, with
``checksums.json``, checked on load) holding ``config.json``
(:class:`~specroll.drafter.eagle_config.EagleConfig`) and ``model.safetensors`` (the head's state
dict); and the checksum a head travels with. ``eagle3_format.py`` converts an "eagle3" drafter to
and from the EAGLE-3 checkpoint vLLM and SGLang load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import msgspec
import safetensors
import torch

from specroll.drafter.eagle_config import DrafterError, EagleConfig
from specroll.engine.loaders.errors import ChecksumError
from specroll.engine.loaders.sealed import check_folder, write_folder
from specroll.engine.loaders.tensor_files import save_tensors

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def write_head_files(path: Path, config: EagleConfig, tensors: Mapping[str, torch.Tensor],
                     keep_previous: bool = False) -> None:
    """Write a head's ``config.json`` and ``model.safetensors`` (CPU, contiguous ``tensors``: its state
    dict) as the sealed folder ``path`` (``sealed.write_folder``: a reader never sees half of it; a
    folder there already is replaced, and kept as ``PATH.prev`` with ``keep_previous``).

    Raises:
        OSError: a file cannot be written (a full disk: ``errno`` in ``sealed.OUT_OF_SPACE``), or
            ``path`` holds files other than a drafter's; ``path`` is left as it was.
    """
    write_folder(path, lambda folder: write_head_into(folder, config, tensors), keep_previous=keep_previous)


def write_head_into(folder: Path, config: EagleConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write the head's two files into the existing ``folder`` as they are (no checksums, not
    atomic): for a caller that seals a folder of its own (the warm-start cache)."""
    save_tensors(tensors, folder / WEIGHTS_FILE, metadata={"format": "specroll-eagle"})
    (folder / CONFIG_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(config), indent=2))


def read_head_files(path: Path) -> tuple[EagleConfig, dict[str, torch.Tensor], str]:
    """A head's config and tensors as :func:`write_head_files` wrote them into ``path``, and the name
    of its weights file for later messages (the tensors are checked by ``EagleHead.from_tensors``).

    Raises:
        DrafterError: a missing or unreadable file, one that fails its checksum (missing, cut short or
            changed since it was written), or a malformed config; the message names the file and the
            value (and, for a vLLM/SGLang EAGLE-3 checkpoint, how to convert it).
    """
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    writers = "as 'specroll init-drafter' or 'specroll drafter train' write it"
    made_by = f"expected a drafter directory ({CONFIG_FILE} + {WEIGHTS_FILE}) {writers}"
    if not path.is_dir():
        raise DrafterError(f"drafter {path}: {'not a directory' if path.exists() else 'does not exist'}; {made_by}")
    try:
        check_folder(path)
    except ChecksumError as exc:
        raise DrafterError(f"drafter {exc}") from None
    for p in (config_path, weights_path):
        if not p.is_file():
            raise DrafterError(f"drafter {path}: {p.name} not found; {made_by}")
    try:
        raw = config_path.read_bytes()
    except OSError as exc:
        raise DrafterError(f"drafter {config_path}: cannot read it ({exc.strerror or exc})") from None
    try:
        config = msgspec.json.decode(raw, type=EagleConfig)
        config.as_model_config()  # the head's layer shape is valid
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        # EagleConfig's own range checks say what they expected; msgspec's messages do not
        hint = "" if str(exc).startswith("drafter config:") else f"; expected a drafter config {writers}"
        if b'"architectures"' in raw:  # a Hugging Face style config: vLLM's / SGLang's EAGLE-3 format
            hint = ("; this looks like an EAGLE-3 checkpoint as vLLM and SGLang load it: convert it with "
                    "'specroll drafter import CHECKPOINT --out DIR' and use DIR")
        raise DrafterError(f"drafter {config_path}: {exc}{hint}") from None
    try:
        with safetensors.safe_open(str(weights_path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, safetensors.SafetensorError) as exc:
        raise DrafterError(f"drafter {weights_path}: not a readable safetensors file ({exc})") from None
    return config, tensors, f"drafter {weights_path}"


def head_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over a head's tensors in name order: each name, dtype, shape and raw bytes.

    The drafter trainer publishes it with a version; a generator recomputes it on what it received
    and serves the head only when the two agree.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()

