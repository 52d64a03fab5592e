"""Error types shared by the checkpoint loaders, the tokenizer and the chat template.

They live here, below every module that raises them, so that no import has to hide inside a
function to dodge a circle (``checkpoint.py`` imports the loaders, which raise these).
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or describes a model specroll does not implement."""


class ChecksumError(CheckpointError):
    """A file of a sealed folder (``sealed.py``) is missing, cut short or changed since it was
    written, or its ``checksums.json`` does not parse. ``path`` is that file."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or its template rejected the conversation."""
