"""Validating a Chat Completions request's ``tools`` and ``tool_choice``.

A tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}``
(OpenAI's Chat Completions API reference, ``tools``); ``parameters`` is a JSON Schema, checked
against the 2020-12 metaschema with ``jsonschema`` (``Draft202012Validator.check_schema``), whose
root describes the arguments object. The work is bounded before any schema is checked: at most
:data:`MAX_TOOLS` tools, each schema at most :data:`MAX_SCHEMA_DEPTH` containers deep and
:data:`MAX_SCHEMA_BYTES` long. Every error is a :class:`ToolSchemaError` naming the field, for the
server to answer with a 400.

specroll samples without grammar constraints, so it cannot force a call or a schema: ``tool_choice``
may only be ``"auto"`` or ``"none"``, and ``strict: true`` is refused. The trainer must see the
distribution that was sampled, which a constrained sampler would change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

__all__ = [
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_TOOLS",
    "FunctionTool",
    "ToolChoice",
    "ToolSchemaError",
    "validate_tool_choice",
    "validate_tools",
]

MAX_TOOLS = 128
"""Most tools one request may list (OpenAI's own limit)."""
MAX_SCHEMA_BYTES = 64 * 1024
"""Longest ``parameters`` schema, in bytes of its ``json.dumps`` (ASCII) encoding."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of objects and arrays in a ``parameters`` schema (``{}`` is depth 1)."""

ToolChoice = Literal["auto", "none"]
"""The ``tool_choice`` values specroll serves: the model may call a tool, or is not offered any."""

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's function name rule
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


class ToolSchemaError(ValueError):
    """A ``tools`` or ``tool_choice`` value the server cannot serve; ``param`` names the field
    (``"tools[1].function.parameters"``), as OpenAI's error object does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One validated tool: a function name, what it does, and the JSON Schema of its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def as_openai(self) -> dict[str, Any]:
        """The tool as an OpenAI ``tools`` entry, the form chat templates render (absent fields
        left out)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def validate_tools(tools: object) -> list[FunctionTool]:
    """The request's ``tools`` (decoded JSON; ``None`` for none), checked and typed.

    Raises:
        ToolSchemaError: ``tools`` is not a list or has more than :data:`MAX_TOOLS` entries; an
            entry is not an object of ``type`` ``"function"`` with only the known keys; a name does
            not match ``^[a-zA-Z0-9_-]{1,64}$`` or repeats an earlier one; ``description`` is not a
            string; ``strict`` is true; ``parameters`` is not an object, is too deep or too long,
            is not a valid JSON Schema, or has a ``type`` other than ``"object"``.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolSchemaError("tools", f"expected a list of tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ToolSchemaError("tools", f"{len(tools)} tools, at most {MAX_TOOLS} are accepted")
    validated: list[FunctionTool] = []
    first_index: dict[str, int] = {}  # name -> the tool that has it
    for index, tool in enumerate(tools):
        function_tool = _function_tool(tool, f"tools[{index}]")
        if (earlier := first_index.setdefault(function_tool.name, index)) != index:
            raise ToolSchemaError(
                f"tools[{index}].function.name", f"{function_tool.name!r} is already the name of tools[{earlier}]"
            )
        validated.append(function_tool)
    return validated


def validate_tool_choice(tool_choice: object, *, has_tools: bool) -> ToolChoice:
    """The request's ``tool_choice``; ``None`` (absent) means ``"auto"`` with tools and ``"none"``
    without, as OpenAI defaults it. With ``"none"`` the model is not to call tools: the server
    treats the whole generation as content.

    Raises:
        ToolSchemaError: anything but ``"auto"``, ``"none"`` or ``None``: ``"required"`` and a
            named function would need grammar-constrained sampling, which specroll does not do.
    """
    if tool_choice is None:
        return "auto" if has_tools else "none"
    if tool_choice == "auto" or tool_choice == "none":
        return tool_choice
    shown = "a named function" if isinstance(tool_choice, dict) else repr(tool_choice)
    raise ToolSchemaError(
        "tool_choice",
        f"{shown} is not supported; only 'auto' and 'none' are: forcing a call needs grammar-constrained "
        "sampling, which specroll does not do, since the trainer must see the distribution that was sampled",
    )


def _function_tool(tool: object, where: str) -> FunctionTool:
    """One ``tools`` entry checked (all but name clashes, which need the others)."""
    entry = _object(tool, where, _TOOL_KEYS)
    if entry.get("type") != "function":
        raise ToolSchemaError(f"{where}.type", f"{entry.get('type')!r}, expected 'function'")
    where = f"{where}.function"
    function = _object(entry.get("function"), where, _FUNCTION_KEYS)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolSchemaError(f"{where}.name", f"{name!r} does not match ^[a-zA-Z0-9_-]{{1,64}}$")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolSchemaError(f"{where}.description", f"expected a string, got {type(description).__name__}")
    strict = function.get("strict")
    if strict is True:
        raise ToolSchemaError(
            f"{where}.strict",
            "true is not supported: specroll samples without grammar constraints, so it cannot enforce "
            "the schema (the trainer must see the distribution that was sampled); leave it unset or false",
        )
    if strict not in (None, False):
        raise ToolSchemaError(f"{where}.strict", f"{strict!r}, expected a boolean")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_parameters(parameters, f"{where}.parameters")
    return FunctionTool(name, description, parameters)


def _object(value: object, where: str, allowed: frozenset[str]) -> dict[str, Any]:
    """``value`` as a JSON object with no keys but ``allowed``."""
    if not isinstance(value, dict):
        raise ToolSchemaError(where, f"expected an object, got {type(value).__name__}")
    if unknown := sorted(value.keys() - allowed):
        raise ToolSchemaError(
            where, f"unknown key(s) {', '.join(map(repr, unknown))}; expected {', '.join(sorted(allowed))}"
        )
    return value


def _check_parameters(parameters: object, where: str) -> None:
    """``parameters``: bounded (depth, then size, so neither walk recurses far), then a valid JSON
    Schema (2020-12) of an object."""
    if not isinstance(parameters, dict):
        raise ToolSchemaError(where, f"expected a JSON Schema object, got {type(parameters).__name__}")
    if _deeper_than(parameters, MAX_SCHEMA_DEPTH):
        raise ToolSchemaError(where, f"objects and arrays nested more than {MAX_SCHEMA_DEPTH} deep")
    size = len(json.dumps(parameters))
    if size > MAX_SCHEMA_BYTES:
        raise ToolSchemaError(where, f"{size} bytes of JSON, at most {MAX_SCHEMA_BYTES} are accepted")
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as exc:
        at = "" if not exc.path else f" (at {exc.json_path})"
        raise ToolSchemaError(where, f"{exc.message}{at}") from exc
    if parameters.get("type", "object") != "object":
        raise ToolSchemaError(
            where, f"type {parameters['type']!r}, expected 'object' (a function's arguments are a JSON object)"
        )


def _deeper_than(value: Mapping[str, Any], limit: int) -> bool:
    """Whether objects and arrays nest more than ``limit`` deep in ``value`` (walked without
    recursion, stopping at the first container past the limit)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
