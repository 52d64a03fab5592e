"""Chat templates with tools: ``tools``, tool-call history and extra template variables reach the
template as transformers passes them; the variables we set cannot be overridden; a template failing
on a message's values is a ChatTemplateError."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.chat_tokenizers import write_template_tokenizer
from transformers import AutoTokenizer

from specroll.engine.loaders.chat_template import template_variables
from specroll.engine.loaders.tokenizer import ChatTemplateError, Tokenizer

# A Qwen2.5-style template, trimmed: tools in the system turn, tool calls in assistant turns,
# consecutive tool results in one user turn, and Qwen3's enable_thinking switch.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.content %}{{- m.content + '\\n' }}{%- endif %}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": '"
    " + c.function.arguments + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21"},
    {"role": "tool", "tool_call_id": "call_2", "name": "now", "content": "12:00"},
]


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_template_tokenizer(tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)


def test_tools_history_and_template_kwargs_render_like_transformers(hermes_dir: Path) -> None:
    ours, reference = Tokenizer.from_hf_dir(hermes_dir), AutoTokenizer.from_pretrained(hermes_dir)
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        for tools in (TOOLS, None):
            rendered = ours.apply_chat_template(CONVERSATION, tools=tools, chat_template_kwargs=kwargs)
            expected = reference.apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                                     add_generation_prompt=True, **kwargs)
            assert rendered == expected, (tools is not None, kwargs)
            ids = ours.encode_chat(CONVERSATION, tools=tools, chat_template_kwargs=kwargs)
            assert ids == ours.encode(rendered, add_special_tokens=False)
    with_tools = ours.apply_chat_template(CONVERSATION, tools=TOOLS)
    weather_line = '\n{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C"'
    assert weather_line in with_tools  # tojson writes the tool as it came, ° included
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>' in with_tools
    assert "<tool_response>\n21\n</tool_response>\n<tool_response>\n12:00" in with_tools
    unthinking = ours.apply_chat_template(CONVERSATION, chat_template_kwargs={"enable_thinking": False})
    assert unthinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Callers that pass neither keyword get what they got before: no tools, no extra variables.
    assert ours.apply_chat_template(CONVERSATION) == ours.apply_chat_template(CONVERSATION, tools=None)
    assert ours.apply_chat_template(CONVERSATION, False).endswith("</tool_response><|im_end|>\n")


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents"])
def test_chat_template_kwargs_may_not_set_the_reserved_variables(hermes_dir: Path, key: str) -> None:
    tokenizer = Tokenizer.from_hf_dir(hermes_dir)
    with pytest.raises(ValueError, match=rf"chat_template_kwargs sets '{key}'.*reserved: add_generation_prompt"):
        tokenizer.apply_chat_template(CONVERSATION, chat_template_kwargs={key: "x", "enable_thinking": False})
    with pytest.raises(ValueError, match=rf"'{key}'"):
        tokenizer.encode_chat(CONVERSATION, chat_template_kwargs={key: "x"})


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}{% endfor %}",  # TypeError
    "{% for m in messages %}{{ m.content.strip() }}{% endfor %}",  # UndefinedError: None has no strip
])
def test_a_template_failing_on_none_content_is_a_chat_template_error(tmp_path: Path, template: str) -> None:
    tokenizer = Tokenizer.from_hf_dir(write_template_tokenizer(tmp_path, template))
    assert tokenizer.apply_chat_template(CONVERSATION[:2])  # string contents render
    with pytest.raises(ChatTemplateError, match=r"chat template failed on these messages \((TypeError|Undefined)"):
        tokenizer.apply_chat_template(CONVERSATION[:3])


def test_template_variables_are_what_the_template_reads() -> None:
    assert {"tools", "messages", "add_generation_prompt", "enable_thinking"} <= template_variables(HERMES_TEMPLATE)
    words_only = "{% for m in messages %}{{ 'tools: none' }}{% set tools = 1 %}{% endfor %}"
    assert template_variables(words_only) == {"messages"}
