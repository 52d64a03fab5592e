"""Write ``docs/configuration.md``, the configuration reference, from the run config's own docstrings.

The sections are found by walking the fields of the root config class, :class:`RunConfig`, as the
public config API (``specroll.actors.config``) exports it: a field whose type is a struct is a
section (``[trainer]``, ``[generator.engine]``, ``[cluster.trainer]``), every other field is a key.
Where a class is defined does not matter, so the schema may live in one file or many.

Each key's row gives its TOML type, its default in ``RunConfig()`` (the resolved defaults, e.g.
``generator.engine.model`` following ``model.name``) and its attribute docstring: the string literal
right after the field in the class body (PEP 257), which Python keeps only in the source, so the
class's source is read with :func:`inspect.getsource` and parsed with :mod:`ast`. A key without a
docstring is an error naming it: the reference has no empty rows.

    python scripts/config_reference.py           # rewrite docs/configuration.md
    python scripts/config_reference.py --check   # exit 1 if the committed page is stale

``tests/test_docs.py`` fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from specroll.actors.config import RunConfig, toml_value

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
"""Where the reference is written (``docs_dir`` of ``mkdocs.yml``)."""
COMMAND = "python scripts/config_reference.py"
"""The command that regenerates :data:`PAGE` (named in the page and in the stale-page test)."""


@dataclass(frozen=True)
class Key:
    """One key of a section: its name, TOML type, default and description (Markdown)."""

    name: str
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    """One config section: its dotted path (``()`` for the top level), its description and keys."""

    path: tuple[str, ...]
    doc: str
    keys: tuple[Key, ...]
    subsections: tuple[tuple[str, ...], ...]


class MissingDocstring(Exception):
    """A config key has no docstring; the message names it."""


def sections(root: type[msgspec.Struct] = RunConfig) -> list[Section]:
    """Every section under ``root``, depth first in field order, the top level first."""
    out: list[Section] = []
    _walk(root, root(), (), _prose(inspect.getdoc(root) or ""), out)
    return out


_SECTION = re.compile(r"^(Args|Arguments|Raises|Returns|Yields|Attributes|Examples?):\s*$", re.M)


def _prose(doc: str) -> str:
    """A class docstring without its Google-style sections (``Raises:`` and the like: for code, not config)."""
    match = _SECTION.search(doc)
    return (doc[:match.start()] if match else doc).strip()


def _walk(cls: type[msgspec.Struct], value: msgspec.Struct, path: tuple[str, ...], intro: str,
          out: list[Section]) -> None:
    docs = field_docstrings(cls)
    hints = typing.get_type_hints(cls)
    keys: list[Key] = []
    nested: list[tuple[type[msgspec.Struct], msgspec.Struct, tuple[str, ...], str]] = []
    for field in msgspec.structs.fields(cls):
        kind = hints[field.name]
        default = getattr(value, field.name)
        if _is_struct(kind):
            class_doc = _prose(inspect.getdoc(kind) or "")
            field_doc = docs.get(field.name, "")
            nested.append((kind, default, (*path, field.name), "\n\n".join(d for d in (field_doc, class_doc) if d)))
            continue
        doc = docs.get(field.name)
        if not doc:
            dotted = ".".join((*path, field.name))
            raise MissingDocstring(f"config key {dotted!r} ({cls.__qualname__}.{field.name}) has no docstring: "
                                   "write one as a string literal right after the field")
        keys.append(Key(field.name, type_name(kind), default_text(default), doc))
    out.append(Section(path, intro, tuple(keys), tuple(p for _, _, p, _ in nested)))
    for kind, default, sub_path, sub_intro in nested:
        _walk(kind, default, sub_path, sub_intro, out)


def _is_struct(kind: object) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


def field_docstrings(cls: type) -> dict[str, str]:
    """The attribute docstrings of ``cls``'s fields (its own and its struct bases'), by field name."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring wins over its base's
        if not _is_struct(klass) or klass is msgspec.Struct:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        node = ast.parse(source).body[0]
        assert isinstance(node, ast.ClassDef), klass
        for stmt, after in itertools.pairwise(node.body):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                found[stmt.target.id] = inspect.cleandoc(after.value.value)
    return found


_SCALARS = {bool: "boolean", int: "integer", float: "float", str: "string"}


def type_name(kind: object) -> str:
    """``kind`` as a TOML type, e.g. ``integer``, ``string (optional)``, ``"tis"`` or ``"ppo"``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        names = [f'`{toml_value(a)}`' for a in args]
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        text = " or ".join(type_name(a) for a in present)
        return f"{text} (optional)" if len(present) < len(args) else text
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"array of {type_name(args[0])}"
        return "array"
    if kind in _SCALARS:
        return _SCALARS[kind]  # type: ignore[index]
    return getattr(kind, "__name__", str(kind))


def default_text(value: object) -> str:
    """A default as TOML (``unset`` for ``None``: TOML has no null)."""
    return "unset" if value is None else f"`{toml_value(value)}`"


_ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc):`~?([^`]+)`")


def markdown(text: str) -> str:
    """reStructuredText of a docstring as Markdown: ````code```` → ```code```, ``:class:`~a.B``` → ```B```."""
    text = _ROLE.sub(lambda m: "`" + _role_target(m.group(0), m.group(1)) + "`", text)
    return text.replace("``", "`")


def _role_target(role: str, target: str) -> str:
    shown = target.rsplit(".", 1)[-1] if "`~" in role else target
    return f"{shown}()" if role.startswith((":meth:", ":func:")) else shown


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped."""
    return " ".join(markdown(text).split()).replace("|", "\\|")


def anchor(path: tuple[str, ...]) -> str:
    """The heading id of a section: ``top-level``, ``trainer``, ``generator-engine``."""
    return "-".join(path) if path else "top-level"


def render() -> str:
    """The whole page, as :data:`PAGE` should hold it."""
    found = sections()
    lines = [
        f"<!-- Generated by `{COMMAND}` from the config schema's docstrings: edit those, then run it. -->",
        "",
        "# Configuration reference",
        "",
        "A run is one TOML file read into `RunConfig` (`specroll.actors.config`): `specroll launch CONFIG.toml` "
        "reads it, writes the resolved config to `RUN_DIR/config.toml`, and every role reads that file. Any key "
        "can be overridden on the command line with `--set SECTION.KEY=VALUE` (e.g. `--set trainer.batch_groups=8`); "
        "an unknown key or a value out of range is one error line naming the key and what was expected, exit 2. "
        "`examples/gsm8k_smollm2.toml` explains its sections.",
        "",
        "Defaults are those of `RunConfig()`, a small valid run on a CPU. *unset* is an optional key left out "
        "(TOML has no null).",
        "",
        "Sections:",
        "",
    ]
    for section in found:
        depth = max(0, len(section.path) - 1)
        lines.append(f"{'    ' * depth}- [{_title(section.path)}](#{anchor(section.path)})")
    for section in found:
        lines += ["", f"## {_title(section.path)} {{#{anchor(section.path)}}}", ""]
        if section.doc:
            lines += [markdown(section.doc), ""]
        if section.subsections:
            links = ", ".join(f"[{_title(p)}](#{anchor(p)})" for p in section.subsections)
            lines += [f"Sub-sections: {links}.", ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for key in section.keys:
            lines.append(f"| `{key.name}` | {_cell(key.type)} | {_cell(key.default)} | {_cell(key.doc)} |")
    return "\n".join(lines) + "\n"


def _title(path: tuple[str, ...]) -> str:
    return f"`[{'.'.join(path)}]`" if path else "Top-level keys"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page differs; write nothing")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write or check (default: %(default)s)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
