"""Small file helpers shared by the actors."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str, mode: int | None = None) -> Path:
    """Write ``text`` (UTF-8) to ``path`` all or nothing: a temp file in the same directory, fsynced,
    then renamed over ``path``; on any error the temp file is removed and ``path`` is untouched. The
    file is readable by its owner only (``mkstemp``'s 0600) unless ``mode`` says otherwise.

    Raises:
        OSError: the directory is not writable (nothing is left behind).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
