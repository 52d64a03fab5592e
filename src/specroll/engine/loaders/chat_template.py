"""Chat templates from checkpoints, rendered the way transformers' ``apply_chat_template`` does.

Templates come from untrusted checkpoints, so they compile in jinja2's
``ImmutableSandboxedEnvironment`` (no attribute writes, no unsafe calls) with transformers'
options (``trim_blocks``, ``lstrip_blocks``, loop controls) and helpers (``raise_exception``,
``strftime_now``, a ``tojson`` without HTML escaping, the ``{% generation %}`` tag).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specroll.engine.loaders.errors import ChatTemplateError, CheckpointError


def read_hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` (newer layout) or tokenizer_config's ``chat_template`` (a string, or
    a list of ``{"name", "template"}`` of which we take ``default``)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's ``{% generation %}…{% endgeneration %}`` (assistant-mask markers) and renders
    the body unchanged; we never compute assistant masks."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API declares it as a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain json.dumps (as transformers does).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' sandbox, options and helpers for chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a checkpoint's chat template with transformers' sandbox and options.

    Raises:
        CheckpointError: the template does not parse.
    """
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from exc


def template_variables(source: str) -> frozenset[str]:
    """Names a chat template reads from its context (``messages``, ``tools``, ``enable_thinking``, and
    helpers such as ``raise_exception``): the undeclared variables of its parsed syntax tree
    (``jinja2.meta.find_undeclared_variables``), found without rendering it.

    Raises:
        CheckpointError: the template does not parse.
    """
    env = _environment()
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from exc
    return frozenset(jinja2.meta.find_undeclared_variables(tree))
