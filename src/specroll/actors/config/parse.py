"""Reading a config document: a TOML file plus ``--set a.b=value`` overrides, and msgspec's
validation errors turned into one :class:`ConfigError` line naming the file, the dotted key and what
was expected (with close matches for an unknown key).

Generic over the root struct; :func:`specroll.actors.config.load.load_config` applies it to
:class:`~specroll.actors.config.run_config.RunConfig`.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from specroll.actors.config.errors import ConfigError


def read_document(
    path: str | Path | None, overrides: Sequence[str], root: type[msgspec.Struct]
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """Read a TOML file (``None``: an empty document) and apply ``--set`` overrides to it.

    Args:
        path: The TOML file, or ``None``.
        overrides: ``"a.b.c=value"`` strings, applied in order (see
            :func:`~specroll.actors.config.load.load_config` for how values are parsed).
        root: the config struct the document describes (an override descends only into its tables).

    Returns:
        ``(source, document, set_by)``: the name errors start with, the table to convert to ``root``,
        and dotted key → the ``--set`` item that set it (for :func:`explain`).

    Raises:
        ConfigError: the file is missing or unreadable, not UTF-8 or not valid TOML, or an override is
            malformed or sets a key inside a value that is not a table.
    """
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{source}: config file not found") from None
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read config file ({exc.strerror or exc})") from exc
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: not UTF-8 text ({exc})") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    set_by: dict[str, str] = {}
    for item in overrides:
        key, value = _parse_override(item, source)
        _apply_override(data, key, value, item, source, root)
        set_by[".".join(key)] = item
    return source, data, set_by


_STRUCTURED = tuple("[{\"'")


def _parse_override(item: str, source: str) -> tuple[list[str], Any]:
    key_text, sep, value_text = item.partition("=")
    if not sep:
        raise ConfigError(f"{source}: --set {item!r}: expected KEY=VALUE, e.g. trainer.group_size=8")
    key = [part.strip() for part in key_text.split(".")]
    if not any(key):
        raise ConfigError(f"{source}: --set {item!r}: empty key before '='")
    if not all(key):
        raise ConfigError(f"{source}: --set {item!r}: key {key_text.strip()!r} has an empty part")
    value_text = value_text.strip()
    if not value_text:
        raise ConfigError(f"{source}: --set {item!r}: empty value (write '\"\"' for an empty string)")
    try:
        return key, tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        if value_text.startswith(_STRUCTURED):
            raise ConfigError(f"{source}: --set {item!r}: invalid TOML value ({exc})") from exc
        return key, value_text  # a bare word: a string


def _apply_override(data: dict[str, Any], key: list[str], value: Any, item: str, source: str,
                    root: type[msgspec.Struct]) -> None:
    table = data
    for depth, part in enumerate(key[:-1]):
        where = key[: depth + 1]
        child = table.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: --set {item!r}: {'.'.join(where)} is {_toml_kind(child)}, not a table")
        kind = _unwrap(_type_at(root, where))
        if not isinstance(kind, mi.StructType | mi.AnyType):  # AnyType: unknown key, reported at convert
            raise ConfigError(f"{source}: --set {item!r}: {'.'.join(where)} is {_schema_kind(kind)}, not a table")
        table = child
    table[key[-1]] = value


def _schema_kind(kind: mi.Type) -> str:
    kinds = {mi.BoolType: "a boolean", mi.IntType: "an integer", mi.FloatType: "a float", mi.StrType: "a string",
             mi.LiteralType: "a string", mi.VarTupleType: "an array", mi.ListType: "an array"}
    return kinds.get(type(kind), "a value")


def _toml_kind(value: object) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array"}
    return kinds.get(type(value), f"a {type(value).__name__}")


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def explain(exc: msgspec.ValidationError, source: str, set_by: dict[str, str], root: type[msgspec.Struct]) -> str:
    """Turn msgspec's ``"<what> - at `$.a.b`"`` into ``"<file>: a.b: <what>, expected ..."``.

    Args:
        exc: the error of converting the document to ``root``.
        source: the file name (or ``<defaults>``) the message starts with.
        set_by: dotted key → the ``--set`` item that set it (named when the bad key is related).
        root: the config struct the document was converted to.
    """
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], match["path"] or ""
    parts: list[str | int] = [int(i) if i else name for name, i in _PART.findall(path)]
    table = ".".join(p for p in parts if isinstance(p, str))
    field_type = _type_at(root, parts)

    if isinstance(exc.__cause__, ValueError):  # raised by a __post_init__: "field=value, expected ..."
        text = str(exc.__cause__)
        if table and re.match(r"^[\w.]+=", text):
            text = f"{table}.{text}"
        elif table:
            text = f"{table}: {text}"
        key = text.partition("=")[0]
    elif unknown := re.match(r"Object contains unknown field `(.*)`", what):
        name = unknown[1]
        key = f"{table}.{name}" if table else name
        text = f"unknown key {key}" + _suggest(name, field_type, key, root)
    else:
        key = _dotted(parts)
        if lit := re.match(r"Invalid enum value (.*)", what):
            text = f"{key}={lit[1]}, expected {_describe(field_type)}"
        else:
            expected = what.replace("Expected `object`", "expected a table").replace("got `object`", "got a table")
            text = f"{key}: {re.sub(r'^Expected', 'expected', expected)}"
    item = next((item for k, item in reversed(set_by.items()) if _related(key, k)), None)
    if item is None:
        return f"{source}: {text}"
    if "expected `str`" in text and "=" in item:
        name, _, value = item.partition("=")
        text += f" (quote a string: --set '{name}=\"{value}\"')"
    elif "expected `array`" in text and "=" in item:
        name, _, value = item.partition("=")
        text += f" (a TOML array: --set '{name}=[\"{value}\"]')"
    return f"{source} (from --set {item!r}): {text}"


def _related(a: str, b: str) -> bool:
    """One dotted key is the other or lies under it (``x.y`` and ``x.y.z``, ``x.y`` and ``x.y[0]``)."""
    short, long = sorted((a, b), key=len)
    return long == short or (long.startswith(short) and long[len(short)] in ".[")


def _dotted(parts: Sequence[str | int]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _type_at(root: type[msgspec.Struct], parts: Sequence[str | int]) -> mi.Type:
    """The msgspec type at a path of the ``root`` document (``AnyType`` where unknown)."""
    kind: mi.Type = mi.type_info(root)
    for part in parts:
        kind = _unwrap(kind)
        if isinstance(part, int) and isinstance(kind, mi.VarTupleType | mi.ListType):
            kind = kind.item_type
        elif isinstance(part, str) and isinstance(kind, mi.StructType):
            kind = next((f.type for f in kind.fields if f.name == part), mi.AnyType())
        else:
            return mi.AnyType()
    return kind


def _unwrap(kind: mi.Type) -> mi.Type:
    """The non-None member of an optional type."""
    if isinstance(kind, mi.UnionType):
        members = [t for t in kind.types if not isinstance(t, mi.NoneType)]
        return members[0] if len(members) == 1 else kind
    return kind


def _describe(kind: mi.Type) -> str:
    kind = _unwrap(kind)
    if isinstance(kind, mi.LiteralType):
        return "one of " + ", ".join(map(repr, kind.values))
    return "a valid value"


def _all_keys(kind: mi.Type, prefix: str = "") -> list[str]:
    keys: list[str] = []
    if isinstance(kind, mi.StructType):
        for f in kind.fields:
            keys.append(prefix + f.name)
            keys += _all_keys(f.type, prefix + f.name + ".")
    return keys


MOVED = {"task.max_retries": "trainer.max_group_retries"}
"""Keys that moved, each to the key that replaced it (named when the old one is used)."""


def _suggest(name: str, table_type: mi.Type, key: str, root: type[msgspec.Struct]) -> str:
    """``"; did you mean X?"`` from the same table, else the same name in another table, else the valid keys;
    for a key that moved (:data:`MOVED`), where it went."""
    if key in MOVED:
        return f"; it moved to {MOVED[key]} (docs/configuration.md)"
    names = [f.name for f in table_type.fields] if isinstance(table_type, mi.StructType) else []
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    prefix = key[: -len(name)]
    if close:
        return "; did you mean " + " or ".join(prefix + c for c in close) + "?"
    elsewhere = [k for k in _all_keys(mi.type_info(root)) if k.rpartition(".")[2] == name]
    if elsewhere:
        return "; did you mean " + " or ".join(elsewhere[:3]) + "?"
    where = f"[{prefix[:-1]}]" if prefix else "the top level"
    return f"; keys in {where}: {', '.join(names)}"
