"""The Hermes prompt for a template that ignores tools: Qwen2.5's text, and a conversation rewritten
so that a plain template renders what Qwen2.5's template would; SmolLM2's template is such a one."""

from __future__ import annotations

import gguf
import pytest

from specroll.actors.server.tool_calls import (
    TOOL_PARSERS,
    choose_tool_parser,
    hermes_fallback_messages,
    template_uses_tools,
    tools_system_prompt,
)
from specroll.engine.loaders.chat_template import compile_chat_template
from specroll.engine.loaders.registry import resolve_model
from specroll.engine.loaders.tokenizer import ChatTemplateError, Tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Wetter in einer Stadt, °C",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}},
]
# Qwen2.5-Instruct's system block for these tools, as its template renders it (copied by hand).
QWEN25_TOOLS_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Wetter in einer Stadt, °C", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
    '{"type": "function", "function": {"name": "now"}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
# Qwen2.5's tool template, trimmed to the parts a conversation with tools uses (its wording inline).
QWEN25_TEMPLATE = (
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first)"
    " or (m.role == 'assistant' and not m.tool_calls) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>' + m.role }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}{%- set c = c.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": ' + c.arguments + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A template that renders role and content only (SmolLM2's, without its default system prompt).
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
]
TURNS = [
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "21 °C at noon. Tomorrow too?", "tool_calls": CALLS[:1]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "19"},
    {"role": "assistant", "content": "19 °C."},
    {"role": "user", "content": "Thanks."},
]


def test_tools_system_prompt_is_qwen25s_text() -> None:
    assert tools_system_prompt(TOOLS) == QWEN25_TOOLS_TEXT


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_fallback_messages_render_as_qwen25s_template_renders_tools(system: str | None) -> None:
    messages = TURNS if system is None else [{"role": "system", "content": system}, *TURNS]
    qwen, plain = compile_chat_template(QWEN25_TEMPLATE), compile_chat_template(PLAIN_TEMPLATE)
    fallback = hermes_fallback_messages(messages, TOOLS)
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in fallback)
    expected = qwen.render(messages=messages, tools=TOOLS, add_generation_prompt=True)
    assert plain.render(messages=fallback, add_generation_prompt=True) == expected
    assert TURNS[1]["content"] is None and "tool_calls" in TURNS[1]  # the caller's messages are unchanged


def test_fallback_messages_without_tools_add_no_system_turn() -> None:
    fallback = hermes_fallback_messages([{"role": "user", "content": "hi"}, *TURNS[1:4]], [])
    assert [m["role"] for m in fallback] == ["user", "assistant", "user"]
    assert fallback[1]["content"].startswith("<tool_call>\n") and fallback[2]["content"].count("<tool_response>") == 2
    empty_system = hermes_fallback_messages([{"role": "system", "content": ""}], TOOLS)
    assert empty_system == [{"role": "system", "content": QWEN25_TOOLS_TEXT}]
    assert hermes_fallback_messages([{"role": "assistant", "content": None}], []) == [
        {"role": "assistant", "content": ""}
    ]
    as_object = {"function": {"name": "now", "arguments": {"tz": "UTC"}}}  # a client sending the object
    (message,) = hermes_fallback_messages([{"role": "assistant", "tool_calls": [as_object]}], [])
    assert message["content"] == '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'


def test_template_uses_tools_reads_the_syntax_tree() -> None:
    assert template_uses_tools(QWEN25_TEMPLATE)
    assert not template_uses_tools(PLAIN_TEMPLATE)
    assert not template_uses_tools(PLAIN_TEMPLATE + "{{ 'no tools here' }}")  # the word, not the variable
    assert template_uses_tools("{% if tools is defined %}x{% endif %}")


@pytest.mark.slow  # loads the default model's GGUF metadata (~2 s)
def test_smollm2s_template_ignores_tools_and_renders_the_fallback() -> None:
    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(resolve_model("smollm2-135m")))
    assert tokenizer.chat_template is not None
    assert not template_uses_tools(tokenizer.chat_template)
    assert choose_tool_parser("auto", tokenizer.chat_template) is TOOL_PARSERS["hermes"]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    plain = tokenizer.apply_chat_template(user)
    assert tokenizer.apply_chat_template(user, tools=TOOLS) == plain  # tools never reach the prompt
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    with pytest.raises(ChatTemplateError, match="TypeError"):  # it concatenates content, None included
        tokenizer.apply_chat_template(TURNS[:2])
    prompt = tokenizer.apply_chat_template(hermes_fallback_messages(TURNS, TOOLS))
    assert prompt.startswith(f"<|im_start|>system\n{QWEN25_TOOLS_TEXT}<|im_end|>\n<|im_start|>user\nWeather")
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\n12:00" in prompt
    assert prompt.endswith("<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n")
