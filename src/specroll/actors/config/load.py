"""Loading a :class:`~specroll.actors.config.run_config.RunConfig`: a TOML file plus ``--set`` overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from specroll.actors.config.errors import ConfigError
from specroll.actors.config.parse import explain, read_document
from specroll.actors.config.run_config import RunConfig


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML file (``None``: start from the defaults), apply ``--set`` overrides, validate.

    Args:
        path: The TOML file, or ``None``.
        overrides: ``"a.b.c=value"`` strings, applied in order. The value is parsed as a TOML value
            (``3``, ``0.5``, ``true``, ``"x"``, ``[1, 2]``, ``{a = 1}``); a bare word that is not valid
            TOML (``runs/x``, ``data.jsonl``) is taken as a string.

    Raises:
        ConfigError: the file is missing or unreadable, not valid TOML (the message has the line), an
            override is malformed, a key is unknown (close matches are suggested), a value has the
            wrong type or is out of range. The message names the file and the dotted key.
    """
    source, data, set_by = read_document(path, overrides, RunConfig)
    try:
        return msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, source, set_by, RunConfig)) from exc
