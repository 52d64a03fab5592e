"""Validating ``tools`` and ``tool_choice``: what is accepted, the field each error names, and the
bounds on the work."""

from __future__ import annotations

import json
import re

import pytest

from specroll.actors.server.tool_schema import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    FunctionTool,
    ToolSchemaError,
    validate_tool_choice,
    validate_tools,
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def tool(name: str = "get_weather", **function: object) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, **function}}


def test_valid_tools_are_typed_and_round_trip() -> None:
    tools = [
        tool(description="Weather in a city", parameters=WEATHER_PARAMETERS),
        tool("now"),
        tool("a" * 64, parameters={}, strict=False),
        tool("snake_and-dash_09", parameters={"type": "object", "properties": {}}, strict=None),
    ]
    validated = validate_tools(tools)
    assert validated[:2] == [
        FunctionTool("get_weather", "Weather in a city", WEATHER_PARAMETERS),
        FunctionTool("now", None, None),
    ]
    assert [t.as_openai() for t in validated[:2]] == tools[:2]
    assert validated[2].as_openai() == tool("a" * 64, parameters={})  # strict is not kept
    assert validate_tools(None) == [] and validate_tools([]) == []
    assert len(validate_tools([tool(f"f{i}") for i in range(MAX_TOOLS)])) == MAX_TOOLS


def _errors() -> list[tuple[object, str, str]]:
    """(tools, param, message pattern) for each kind of bad ``tools``."""
    deep: object = "leaf"
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = [deep]
    return [
        ("get_weather", "tools", "expected a list of tools, got str"),
        ([tool(f"f{i}") for i in range(MAX_TOOLS + 1)], "tools", f"{MAX_TOOLS + 1} tools, at most {MAX_TOOLS}"),
        ([tool(), 3], "tools[1]", "expected an object, got int"),
        ([{**tool(), "extra": 1}], "tools[0]", "unknown key.*'extra'"),
        ([{"type": "custom", "function": {"name": "f"}}], "tools[0].type", "'custom', expected 'function'"),
        ([{"type": "function"}], "tools[0].function", "expected an object, got NoneType"),
        ([tool(parameters={}, returns={})], "tools[0].function", "unknown key.*'returns'"),
        ([tool("get weather")], "tools[0].function.name", r"'get weather' does not match \^\[a-zA-Z0-9_-\]\{1,64\}\$"),
        ([tool("a" * 65)], "tools[0].function.name", "'a{65}' does not match"),
        ([tool("")], "tools[0].function.name", "'' does not match"),
        ([tool(3)], "tools[0].function.name", "3 does not match"),
        ([tool("f"), tool("g"), tool("f")], "tools[2].function.name", r"'f' is already the name of tools\[0\]"),
        ([tool(description=3)], "tools[0].function.description", "expected a string, got int"),
        ([tool(strict=True)], "tools[0].function.strict", "true is not supported.*grammar constraints"),
        ([tool(strict="yes")], "tools[0].function.strict", "'yes', expected a boolean"),
        ([tool(parameters=[])], "tools[0].function.parameters", "expected a JSON Schema object, got list"),
        ([tool(parameters={"type": "object", "properties": {"a": {"type": 5}}})],
         "tools[0].function.parameters", r"5 is not valid .* \(at \$\.properties\.a\.type\)"),
        ([tool(parameters={"type": "object", "required": "city"})],
         "tools[0].function.parameters", r"'city' is not of type 'array' \(at \$\.required\)"),
        ([tool(parameters={"type": "string"})], "tools[0].function.parameters", "type 'string', expected 'object'"),
        ([tool(parameters={"x-deep": deep})],
         "tools[0].function.parameters", f"objects and arrays nested more than {MAX_SCHEMA_DEPTH} deep"),
        ([tool(parameters={"description": "x" * MAX_SCHEMA_BYTES})],
         "tools[0].function.parameters", f"{MAX_SCHEMA_BYTES + 19} bytes of JSON, at most {MAX_SCHEMA_BYTES}"),
    ]


@pytest.mark.parametrize(("tools", "param", "message"), _errors())
def test_bad_tools_name_the_field(tools: object, param: str, message: str) -> None:
    with pytest.raises(ToolSchemaError, match=f"^{re.escape(param)}: {message}") as caught:
        validate_tools(tools)
    assert caught.value.param == param
    assert isinstance(caught.value, ValueError)  # the server answers ValueErrors with a 400


def test_the_message_for_an_invalid_schema_is_jsonschemas() -> None:
    with pytest.raises(ToolSchemaError) as caught:
        validate_tools([tool("f"), tool("g", parameters={"type": "objec"})])
    assert str(caught.value) == (
        "tools[1].function.parameters: 'objec' is not valid under any of the given schemas (at $.type)"
    )
    assert caught.value.param == "tools[1].function.parameters"


def test_the_bounds_are_inclusive() -> None:
    leaf: object = "x"  # under the schema object, MAX_SCHEMA_DEPTH - 1 lists: exactly the limit
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        leaf = [leaf]
    validate_tools([tool(parameters={"x-deep": leaf})])
    padding = MAX_SCHEMA_BYTES - len(json.dumps({"description": ""}))
    validate_tools([tool(parameters={"description": "x" * padding})])
    with pytest.raises(ToolSchemaError, match="bytes of JSON"):
        validate_tools([tool(parameters={"description": "x" * (padding + 1)})])


def test_tool_choice_is_auto_or_none() -> None:
    assert validate_tool_choice(None, has_tools=True) == "auto"
    assert validate_tool_choice(None, has_tools=False) == "none"
    assert validate_tool_choice("auto", has_tools=True) == "auto"
    assert validate_tool_choice("none", has_tools=True) == "none"
    for choice, shown in (("required", "'required'"),
                          ({"type": "function", "function": {"name": "f"}}, "a named function"),
                          ("any", "'any'")):
        with pytest.raises(ToolSchemaError, match=(
            f"^tool_choice: {shown} is not supported; only 'auto' and 'none' are: .*grammar-constrained.*"
            "the trainer must see the distribution that was sampled"
        )) as caught:
            validate_tool_choice(choice, has_tools=True)
        assert caught.value.param == "tool_choice"

