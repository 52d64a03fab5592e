"""Small file helpers shared by the actors."""

from __future__ import annotations

from pathlib import Path

from specroll.engine.loaders.sealed import write_bytes_atomic


def write_text_atomic(path: str | Path, text: str, mode: int | None = None) -> Path:
    """Write ``text`` (UTF-8) to ``path`` all or nothing (``sealed.write_bytes_atomic``: a temp file in
    the same directory, fsynced, renamed over ``path``); on any error the temp file is removed and
    ``path`` is untouched. The file is readable by its owner only (0600) unless ``mode`` says otherwise.

    Raises:
        OSError: the directory is not writable or the disk is full (nothing is left behind).
    """
    return write_bytes_atomic(Path(path), text.encode("utf-8"), 0o600 if mode is None else mode)
