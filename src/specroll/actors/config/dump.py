"""Writing a run config back as TOML: every field, defaults included, so the file is the whole
resolved config (``load_config(write_resolved(c, d)) == c``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import msgspec

from specroll.actors.config.run_config import RunConfig
from specroll.actors.shared.files import write_text_atomic

CONFIG_FILENAME = "config.toml"
"""Name of the resolved config inside the run directory."""


def dump_config(config: RunConfig) -> str:
    """The config as TOML: top-level keys first, then one ``[table]`` per section; ``None`` omitted.

    Every field is written, defaults included, so the file is the whole resolved config.
    """
    lines = ["# specroll run config, resolved: every field (unset optional fields omitted)"]
    _emit_table(lines, (), msgspec.to_builtins(config))
    return "\n".join(lines) + "\n"


def write_resolved(config: RunConfig, run_dir: str | Path | None = None) -> Path:
    """Write ``run_dir/config.toml`` (``run_dir`` defaults to ``config.run_dir``) atomically.

    The text goes to a temporary file in the same directory, is fsynced, then renamed over the
    target, so a reader sees the old file or the whole new one; on any error the temporary file is
    removed and the error propagates.

    Returns:
        The path of the written file.
    """
    directory = Path(config.run_dir if run_dir is None else run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(directory / CONFIG_FILENAME, dump_config(config))


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _emit_table(lines: list[str], path: tuple[str, ...], table: dict[str, Any]) -> None:
    # TOML: a table's own key/value pairs must come before its sub-tables.
    for key, value in table.items():
        if value is not None and not isinstance(value, dict):
            lines.append(f"{_key(key)} = {toml_value(value)}")
    for key, value in table.items():
        if isinstance(value, dict):
            lines += ["", "[" + ".".join(_key(k) for k in (*path, key)) + "]"]
            _emit_table(lines, (*path, key), value)


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _string(key)


def _string(text: str) -> str:
    escaped = "".join(_ESCAPES.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return f'"{escaped}"'


def toml_value(value: object) -> str:
    """``value`` as a TOML value (``--set`` accepts it back).

    Raises:
        TypeError: a type TOML cannot hold (``None`` inside an array, an object).
    """
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form; "1e-06" is valid TOML
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        if any(v is None for v in value):
            raise TypeError(f"cannot write None inside a TOML array: {value!r}")
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None)
        return "{" + items + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML: {value!r}")
