"""Tool calls out of generated text (Hermes format): what counts as a call, what stays content, and
the streaming parser agreeing with the whole-text parse on any split of the text."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from specroll.actors.server.tool_calls import (
    TOOL_PARSERS,
    HermesToolParser,
    ParsedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallIds,
    choose_tool_parser,
)

NAMES = ("get_weather", "now")
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
BAD_JSON = '<tool_call>\n{"name": "now", "arguments": {}\n</tool_call>'  # one brace short


def ids(seed: int = 0) -> ToolCallIds:
    return ToolCallIds(random.Random(seed))


def expected_ids(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"call_{rng.getrandbits(96):024x}" for _ in range(count)]


def parse(text: str, names: tuple[str, ...] = NAMES) -> ParsedToolCalls:
    return HermesToolParser().parse(text, names, ids())


def test_calls_are_parsed_and_the_text_before_them_is_content() -> None:
    parsed = parse(f"Let me look that up.\n{WEATHER}\n{NOW}")
    first, second = expected_ids(2)
    assert parsed == ParsedToolCalls(
        "Let me look that up.\n",
        [ToolCall(first, "get_weather", '{"city": "Zürich"}'), ToolCall(second, "now", "{}")],
        parse_errors=0,
    )
    assert re.fullmatch(r"call_[0-9a-f]{24}", first) and first != second
    assert parse(f"\n{WEATHER}\n\n{NOW}\n").content is None  # only whitespace outside the calls
    assert parse('<tool_call>{"name": "now"}</tool_call>').tool_calls[0].arguments == "{}"  # no arguments


@pytest.mark.parametrize("block", [
    BAD_JSON,
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not one of the request's tools
    '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "now", "arguments": {}, "id": 3}\n</tool_call>',  # a key we would drop
    '<tool_call>\n{"name": ["now"], "arguments": {}}\n</tool_call>',  # name not a string
    '<tool_call>\n["now", {}]\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "now", "arguments": {"x": NaN}}\n</tool_call>',  # NaN is not JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # never closed (max_tokens)
])
def test_a_bad_block_is_counted_and_kept_in_content(block: str) -> None:
    parsed = parse(f"Checking.\n{WEATHER}\n{block}")
    assert parsed.parse_errors == 1
    assert parsed.content == f"Checking.\n{block}"
    assert [call.name for call in parsed.tool_calls] == ["get_weather"]
    alone = parse(block)
    assert (alone.content, alone.tool_calls, alone.parse_errors) == (block, [], 1)


def test_text_after_and_between_calls_is_content_unless_it_is_whitespace() -> None:
    assert parse(f"{WEATHER}\nI also need the time.\n{NOW}\n").content == "\nI also need the time.\n"
    assert parse(f"  {WEATHER}Done.").content == "  Done."  # the text before the first block is kept whole
    assert parse("No tools needed: 42.") == ParsedToolCalls("No tools needed: 42.", [], 0)
    assert parse(" \n\t") == ParsedToolCalls(None, [], 0)
    assert parse("") == ParsedToolCalls(None, [], 0)
    # A tag inside a block's body is part of the body; the first </tool_call> closes the block.
    nested = '<tool_call>\n{"name": "now", "arguments": {"q": "<tool_call>"}}\n</tool_call>'
    assert parse(nested).tool_calls[0].arguments == '{"q": "<tool_call>"}'


def test_ids_come_from_the_callers_rng() -> None:
    text = f"{WEATHER}{NOW}{WEATHER}"
    assert [c.id for c in parse(text).tool_calls] == expected_ids(3)
    assert [c.id for c in HermesToolParser().parse(text, NAMES, ids(7)).tool_calls] == expected_ids(3, seed=7)
    assert ToolCallIds(random.Random(0), prefix="chatcmpl-tool-")() == "chatcmpl-tool-" + expected_ids(1)[0][5:]
    assert re.fullmatch(r"call_[0-9a-f]{24}", ToolCallIds()())  # the operating system's randomness


# Texts for the streaming parser: every way a block, a partial tag and whitespace can meet.
STREAM_TEXTS = [
    f"Let me check.\n{WEATHER}\n{NOW}",
    f"\n\n{WEATHER}\n\n",
    f"  \n{BAD_JSON}\n{WEATHER} and then <b>bold</b> <tool_ <tool_call",
    f"{WEATHER}\n   \n{NOW}\nDone: < <t <to <tool_cal>.",
    f"x{NOW}{NOW}y{BAD_JSON}\n\nz",
    '<tool_call>\n{"name": "now", "arguments": {"q": "</tool_call"}}</tool_call></tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
    "plain text, no calls at all; <tool_call> never closes",
    "   ",
    "",
]


def stream_in_pieces(text: str, cuts: list[int]) -> tuple[list[StreamDelta], ParsedToolCalls]:
    stream = HermesToolParser().stream(NAMES, ids())
    bounds = [0, *cuts, len(text)]
    deltas = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    deltas.append(stream.finish())
    return deltas, stream.result()


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_equals_the_whole_parse_on_random_splits(text: str) -> None:
    whole = parse(text)
    rng = random.Random(len(text))
    splits = [[], list(range(1, len(text)))]  # one delta, and one character a delta
    splits += [sorted(rng.sample(range(1, len(text)), rng.randint(1, max(1, len(text) // 3))))
               for _ in range(40) if len(text) > 1]
    for cuts in splits:
        deltas, result = stream_in_pieces(text, cuts)
        assert result == whole, cuts
        assert "".join(d.content for d in deltas) == (whole.content or ""), cuts
        calls = [call for d in deltas for call in d.tool_calls]
        assert [c.index for c in calls] == list(range(len(whole.tool_calls)))
        assert [ToolCall(c.id, c.name, c.arguments) for c in calls] == whole.tool_calls


def test_streaming_holds_back_a_partial_tag_and_releases_what_cannot_be_one() -> None:
    stream = HermesToolParser().stream(NAMES, ids())
    assert stream.feed("Sure <") == StreamDelta("Sure ")
    assert stream.feed("tool_c") == StreamDelta("")  # "<tool_c" may still become the tag
    assert stream.feed("all>\n{\"name\": \"now\", ") == StreamDelta("")
    closed = stream.feed('"arguments": {}}\n</tool')
    assert closed == StreamDelta("")  # "</tool" may still close it
    delta = stream.feed("_call>\n")
    assert delta.content == "" and [c.name for c in delta.tool_calls] == ["now"]
    assert stream.feed("  ") == StreamDelta("")  # whitespace after a call: not yet content
    assert stream.feed("<b") == StreamDelta("\n  <b")  # "<b" cannot begin the tag
    assert stream.feed(" <tool") == StreamDelta(" ")
    assert stream.finish() == StreamDelta("<tool")  # a partial tag at the end is content
    assert stream.result().content == "Sure \n  <b <tool"


def test_stream_delta_and_call_have_openais_shapes() -> None:
    openai_chat = pytest.importorskip("openai.types.chat")
    chunk_types = pytest.importorskip("openai.types.chat.chat_completion_chunk")
    stream = HermesToolParser().stream(NAMES, ids())
    (delta,) = stream.feed(f"{WEATHER}").tool_calls
    first_id = expected_ids(1)[0]
    assert delta.as_openai() == {"index": 0, "id": first_id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    streamed = chunk_types.ChoiceDeltaToolCall.model_validate(delta.as_openai())
    assert (streamed.index, streamed.id, streamed.function.name) == (0, first_id, "get_weather")
    (call,) = parse(WEATHER).tool_calls
    message_call = openai_chat.ChatCompletionMessageToolCall.model_validate(call.as_openai())
    assert (message_call.id, message_call.type, message_call.function.arguments) == (
        first_id, "function", '{"city": "Zürich"}'
    )


def test_stream_refuses_misuse() -> None:
    stream = HermesToolParser().stream(NAMES, ids())
    with pytest.raises(RuntimeError, match="before finish"):
        stream.result()
    stream.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        stream.feed("x")
    with pytest.raises(RuntimeError, match="twice"):
        stream.finish()


HERMES_TEMPLATE = "{% if tools %}{{ tools | tojson }} answer in <tool_call></tool_call>{% endif %}{{ messages }}"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role + ': ' + m.content }}{% endfor %}"
PYTHON_TAG_TEMPLATE = "{% if tools %}{{ tools | tojson }} answer with <|python_tag|>{% endif %}{{ messages }}"


def test_the_parser_is_chosen_by_setting_then_by_template() -> None:
    hermes = TOOL_PARSERS["hermes"]
    assert choose_tool_parser("auto", HERMES_TEMPLATE) is hermes
    assert choose_tool_parser("auto", PLAIN_TEMPLATE) is hermes  # the server prompts with the Hermes text
    assert choose_tool_parser("auto", None) is hermes
    assert choose_tool_parser("auto", PYTHON_TAG_TEMPLATE) is None  # tools in a format we cannot read
    assert choose_tool_parser("hermes", PYTHON_TAG_TEMPLATE) is hermes  # the setting overrides
    with pytest.raises(ValueError, match=r"server\.tool_parser='mistral' is not a known tool parser.*'hermes'"):
        choose_tool_parser("mistral", HERMES_TEMPLATE)
