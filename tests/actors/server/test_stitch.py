"""Token-in-token-out turns (``actors/server/stitch.py``): a session's next prompt is its last
prompt, the completion exactly as sampled, and the new messages' tokens — equal to rendering the
whole conversation when the model's tokens are what the template would write, and never drifting
when they are not; a template that is not prefix-preserving, a changed tool set or history, or a
rewritten assistant turn is rendered whole with the reason counted."""

from __future__ import annotations

from array import array

import pytest
from helpers.chat_tokenizers import write_template_tokenizer

from specroll.actors.server.stitch import ChatTurn, Transcripts, continuation_ids, reply_key
from specroll.actors.server.tool_prompt import hermes_fallback_messages
from specroll.engine.loaders.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAST_MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (latest){% endif %}\n"
               "{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Marks the last message: adding one changes how the one before it renders (not prefix-preserving)."""
TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def _tokenizer(tmp_path, template: str) -> Tokenizer:
    return Tokenizer.from_hf_dir(write_template_tokenizer(tmp_path / "tok", template))


def _render(tok: Tokenizer):
    return lambda messages, add: tok.apply_chat_template(messages, add)


def _first_turn(tok: Tokenizer, completion_text: str, tools: list | None = None) -> tuple[ChatTurn, list]:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2 * 3?"}]
    prompt = tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False)
    completion = [*tok.encode(completion_text, add_special_tokens=False), tok.eos_token_ids[0]]  # stopped on EOS
    turn = ChatTurn(messages, tools or [], None, array("q", prompt), array("q", completion),
                    reply_key(completion_text, []))
    return turn, messages


def test_the_stitched_prompt_is_the_whole_render_when_the_tokens_are_the_templates(tmp_path):
    tok = _tokenizer(tmp_path, CHATML)
    last, messages = _first_turn(tok, "6")
    messages = [*messages, {"role": "assistant", "content": "6"}, {"role": "user", "content": "And 3 * 4?"}]
    ids, outcome = continuation_ids(last, messages, [], None, _render(tok), tok)
    assert outcome == "stitched"
    assert ids == tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False)
    assert ids[: len(last.prompt) + len(last.completion)] == [*last.prompt, *last.completion]


def test_the_model_tokens_stay_as_sampled_where_a_whole_render_would_rewrite_them(tmp_path):
    tok = _tokenizer(tmp_path, CHATML)
    sampled = '<tool_call>\n{"name":"calc","arguments":{"x":1}}\n</tool_call>'  # no spaces: as the model wrote it
    last, messages = _first_turn(tok, sampled)
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    last = ChatTurn(last.messages, [TOOL], None, last.prompt, last.completion, reply_key(None, [call]))
    messages = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "6"}]

    def render(some, add):
        return tok.apply_chat_template(hermes_fallback_messages(some, [TOOL]), add)

    ids, outcome = continuation_ids(last, messages, [TOOL], None, render, tok)
    assert outcome == "stitched"
    assert ids[: len(last.prompt) + len(last.completion)] == [*last.prompt, *last.completion]
    bridge_and_new = "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ids[len(last.prompt) + len(last.completion):] == tok.encode(bridge_and_new, add_special_tokens=False)
    whole = tok.encode(render(messages, True), add_special_tokens=False)
    assert ids != whole  # a whole render writes the call again with spaces: what the model never produced


@pytest.mark.parametrize(("change", "reason"), [
    ("tools", "tools_changed"), ("history", "history_changed"), ("assistant", "assistant_turn_changed"),
    ("added_assistant", "assistant_turn_added"), ("template", "template_not_prefix_preserving"),
])
def test_what_cannot_be_stitched_exactly_is_rendered_whole_and_says_why(tmp_path, change, reason):
    tok = _tokenizer(tmp_path, LAST_MARKED if change == "template" else CHATML)
    last, messages = _first_turn(tok, "6", tools=[TOOL])
    tools = [] if change == "tools" else [TOOL]
    history = [{"role": "system", "content": "other"}, messages[1]] if change == "history" else messages
    assistant = {"role": "assistant", "content": "7" if change == "assistant" else "6"}
    new = [{"role": "user", "content": "next"}]
    if change == "added_assistant":
        new = [*new, {"role": "assistant", "content": "made up"}, {"role": "user", "content": "?"}]
    ids, outcome = continuation_ids(last, [*history, assistant, *new], tools, None, _render(tok), tok)
    assert ids is None and outcome == reason


def test_tool_call_arguments_compare_parsed_and_transcripts_are_bounded():
    written = [{"function": {"name": "calc", "arguments": '{"expression": "2*3"}'}}]
    rewritten = [{"function": {"name": "calc", "arguments": '{ "expression" :"2*3" }'}}]
    assert reply_key(None, written) == reply_key("", rewritten) != reply_key("", [])
    transcripts = Transcripts(2)
    turn = ChatTurn([], [], None, array("q"), array("q"), ("", ()))
    for session in ("a", "b", "c"):
        transcripts.record(session, turn)
    assert transcripts.get("a") is None and transcripts.get("c") is turn and len(transcripts) == 2
    off = Transcripts(0)
    off.record("a", turn)
    assert len(off) == 0
