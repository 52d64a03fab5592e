"""Tolerant reading of the JSONL files of a run directory (for ``specroll report``): every line
that cannot be read, and every field of the wrong type, becomes one warning naming the file and the
line, and the rest is kept.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_jsonl(path: Path, warnings: list[str]) -> list[tuple[int, dict[str, object]]]:
    """The JSON objects of a JSONL file with their 1-based line numbers. A missing file, a line that
    is not a JSON object and a last line cut short each append one line to ``warnings``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        warnings.append(f"{path}: missing")
        return []
    except OSError as e:
        warnings.append(f"{path}: cannot be read ({e.strerror or e})")
        return []
    lines = data.split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        cut = number == len(lines)  # no newline after it: the writer may have been killed mid-line
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            what = "cut short (no newline at the end: the run was killed mid-write?)" if cut else f"not JSON ({e})"
            warnings.append(f"{path}: line {number}: {what}; skipped")
            continue
        if not isinstance(record, dict):
            warnings.append(f"{path}: line {number}: a JSON {type(record).__name__}, expected an object; skipped")
            continue
        records.append((number, record))
    return records


def show(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a warning stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Fields:
    """Typed reads of one JSON object; the fields of the wrong type are collected for one warning."""

    def __init__(self, record: dict[str, object]) -> None:
        self.record = record
        self.bad: list[str] = []

    def number(self, key: str, required: bool = False) -> float | None:
        value = self.record.get(key)
        if value is None:
            if required:
                self.bad.append(f"no {key}")
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.bad.append(f"{key}={show(value)} (expected a number)")
            return None
        return float(value) if math.isfinite(value) else None  # json writes a NaN loss as NaN: not drawn

    def integer(self, key: str, required: bool = False) -> int | None:
        value = self.record.get(key)
        if value is None:
            if required:
                self.bad.append(f"no {key}")
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad.append(f"{key}={show(value)} (expected an integer)")
            return None
        return value

    def text(self, key: str, required: bool = False) -> str | None:
        value = self.record.get(key)
        if value is None:
            if required:
                self.bad.append(f"no {key}")
            return None
        if not isinstance(value, str):
            self.bad.append(f"{key}={show(value)} (expected a string)")
            return None
        return value

    def warn(self, path: Path, number: int, warnings: list[str]) -> None:
        """One warning for the line, naming every field that was missing or of the wrong type."""
        if self.bad:
            warnings.append(f"{path}: line {number}: {'; '.join(self.bad)}; not drawn")
