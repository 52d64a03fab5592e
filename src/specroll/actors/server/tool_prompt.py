"""Telling a model about tools when its chat template does not: Hermes-style prompt text.

Templates written for tool use (Qwen2.5, Qwen3, Hermes 2/3) render an OpenAI ``tools`` list into
their system message and expect the model to answer with ``<tool_call>`` blocks. A template that
never reads ``tools`` (SmolLM2-135M-Instruct's, the default model) drops them; for those the server
writes the same instructions itself: :func:`tools_system_prompt` is the text, and
:func:`hermes_fallback_messages` rewrites a conversation (tool calls and tool results included)
into the plain ``role``/``content`` messages such a template can render.

Source of the format: Qwen2.5-Instruct's ``tokenizer_config.json`` chat template (its ``# Tools``
system block, ``<tool_call>`` assistant turns and ``<tool_response>`` user turns), which follows
NousResearch's Hermes 2 Pro function-calling format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from specroll.engine.loaders.chat_template import template_variables

__all__ = ["hermes_fallback_messages", "template_uses_tools", "tools_system_prompt"]

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def template_uses_tools(template_source: str) -> bool:
    """Whether a chat template reads the ``tools`` variable at all (its syntax tree, not its text:
    the word in a literal string does not count).

    Raises:
        CheckpointError: the template does not parse.
    """
    return "tools" in template_variables(template_source)


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes/Qwen2.5 instructions for ``tools``: each OpenAI tool dict as one JSON line inside
    ``<tools></tools>``, then the ``<tool_call>`` answer format. The text Qwen2.5's template puts
    after its system prompt, byte for byte (its ``tojson``: ``json.dumps`` without ASCII escaping)."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _TOOLS_HEADER + lines + _TOOLS_FOOTER


def hermes_fallback_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` rewritten for a template that renders only ``role`` and ``content``, as
    Qwen2.5's template would render them with ``tools``:

    - the :func:`tools_system_prompt` joins the first system message (after a blank line), or
      becomes a new first system message (none when ``tools`` is empty);
    - an assistant message's ``tool_calls`` become ``<tool_call>`` blocks after its content, one a
      line (``arguments`` written as the JSON string the client sent);
    - consecutive ``tool`` messages become one ``user`` message of ``<tool_response>`` blocks;
    - ``None`` content becomes ``""``; other keys (``tool_call_id``, ``name``) are dropped.

    The messages are expected valid (as the server's request schema checks them); a malformed tool
    call raises ``KeyError``/``TypeError``.
    """
    out: list[dict[str, Any]] = []
    after_tool = False  # the previous message was a tool result: this one joins its user turn
    for message in messages:
        role, content = message["role"], message.get("content")
        if role == "tool":
            block = f"<tool_response>\n{content or ''}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_tool_call_block(call) for call in message["tool_calls"]]
            content = "\n".join([content, *blocks] if content else blocks)
        out.append({"role": role, "content": "" if content is None else content})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _tool_call_block(call: Mapping[str, Any]) -> str:
    """One OpenAI assistant ``tool_calls`` entry as the ``<tool_call>`` block the model writes."""
    function = call["function"]
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    name = json.dumps(function["name"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {arguments}}}\n</tool_call>'
