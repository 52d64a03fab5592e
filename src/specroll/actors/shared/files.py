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


def ends_a_line(path: Path) -> bool:
    """Whether ``path`` is missing, empty or ends with a newline (else a process was killed, or a full
    disk stopped it, in the middle of a line: the next line must start on its own)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return True
            f.seek(-1, 2)
            return f.read(1) == b"\n"
    except FileNotFoundError:
        return True


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (no newline in it) and a newline to the JSONL file ``path``, on a line of its own.

    Raises:
        OSError: naming ``path`` (a full disk, an unwritable folder).
    """
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(("" if ends_a_line(path) else "\n") + line + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
