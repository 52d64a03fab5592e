"""Token-in-token-out chat turns: a session's next prompt is its last prompt, the tokens the model
produced, and the tokens of the new messages only — earlier turns are never rendered and tokenized
again.

Re-rendering a conversation each turn drifts from what the model saw and produced: a tool call the
model wrote as ``{"name":"calculator", ...}`` comes back from the client as a parsed ``tool_calls``
entry and is written again with other spacing; templates drop earlier reasoning (Qwen3's
``<think>`` blocks); a token sequence seldom survives decode → encode. An RL trainer then trains on
tokens the generator never saw. With an ``X-Session-ID``, a chat request whose messages are the
session's last request's messages, then the assistant message the server returned for it (content
and tool calls as returned), then messages that are not the assistant's, gets the prompt
``last prompt + last completion + the new messages' tokens``.

The new messages' tokens are what the chat template writes for them after an assistant turn:
``render(history + [assistant: S] + new, add_generation_prompt)`` minus ``render(history +
[assistant: S])``, S a sentinel content; plus what the template writes after an assistant turn's
content (its end of turn, ``<|im_end|>\\n`` in ChatML) less the stop token the completion already
ends with. When the second render does not start with the first (the template is not
prefix-preserving over these messages), or the tools or template arguments changed, or the history
is not the session's, the prompt is rendered from the messages as without a session and the
reason is counted (:attr:`Transcripts.misses`): the trainer then trains that turn as a sequence of
its own (``specroll.rl.episodes.stitch``), never a silent drift.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specroll.engine.loaders.tokenizer import Tokenizer

SENTINEL = "\u2063specroll-assistant-turn\u2063"
"""The assistant content of the renders that measure the new messages' text (invisible separators
around a name no model writes)."""

Render = Callable[[list[dict[str, Any]], bool], str]
"""``(messages, add_generation_prompt)`` → the chat template's text, tools and template arguments
applied as the request's (and the Hermes fallback where the template ignores tools)."""


@dataclass(frozen=True)
class ChatTurn:
    """What a session keeps of its last chat turn (one choice)."""

    messages: list[dict[str, Any]]
    """The request's messages, as normalised by the server."""
    tools: list[dict[str, Any]]
    template_kwargs: dict[str, Any] | None
    prompt: array
    """The prompt's token ids (int64 array: compact)."""
    completion: array
    """The completion's token ids."""
    reply: tuple[str, tuple[tuple[str, Any], ...]]
    """The assistant message returned: its content (``""`` for none) and its tool calls as
    ``(name, parsed arguments)``."""


def reply_key(content: str | None, tool_calls: Sequence[dict[str, Any]]) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """An assistant message as compared across turns: its content and its tool calls' names and
    arguments, parsed (clients write arguments back with their own spacing)."""
    calls = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append((function.get("name"), _frozen(arguments)))
    return content or "", tuple(calls)


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def continuation_ids(last: ChatTurn, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     template_kwargs: dict[str, Any] | None, render: Render,
                     tokenizer: Tokenizer) -> tuple[list[int] | None, str]:
    """The stitched prompt of ``messages`` after ``last`` (module docstring), or ``(None, reason)``
    when it cannot be stitched exactly."""
    k = len(last.messages)
    if tools != last.tools:
        return None, "tools_changed"
    if template_kwargs != last.template_kwargs:
        return None, "template_kwargs_changed"
    if len(messages) < k + 2 or messages[:k] != last.messages:
        return None, "history_changed"
    assistant, new = messages[k], messages[k + 1 :]
    if assistant.get("role") != "assistant" or \
            reply_key(assistant.get("content"), assistant.get("tool_calls") or []) != last.reply:
        return None, "assistant_turn_changed"
    if any(m.get("role") == "assistant" for m in new):
        return None, "assistant_turn_added"
    history = [*messages[:k], {"role": "assistant", "content": SENTINEL}]
    before, after = render(history, False), render(history + new, True)
    if not after.startswith(before) or SENTINEL not in before:
        return None, "template_not_prefix_preserving"
    end_of_turn = before[before.rindex(SENTINEL) + len(SENTINEL) :]
    if last.completion and last.completion[-1] in tokenizer.eos_token_ids:
        stop = tokenizer.decode([last.completion[-1]], skip_special_tokens=False)
        if not end_of_turn.startswith(stop):
            return None, "end_of_turn_differs"
        end_of_turn = end_of_turn[len(stop) :]
    new_ids = tokenizer.encode(end_of_turn + after[len(before) :], add_special_tokens=False)
    return [*last.prompt, *last.completion, *new_ids], "stitched"


class Transcripts:
    """Session id → its last :class:`ChatTurn`, least recently used first; at most ``max_sessions``
    (0: none kept, every turn rendered from its messages).

    Attributes:
        outcomes: turns with a session and a kept last turn, by outcome: ``stitched`` or the reason
            they were rendered from their messages (``tools_changed``, ``history_changed``,
            ``template_not_prefix_preserving``, ...).
    """

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, ChatTurn] = OrderedDict()
        self.outcomes: Counter[str] = Counter()

    def get(self, session_id: str) -> ChatTurn | None:
        turn = self._last.get(session_id)
        if turn is not None:
            self._last.move_to_end(session_id)
        return turn

    def record(self, session_id: str, turn: ChatTurn) -> None:
        if self.max_sessions == 0:
            return
        self._last[session_id] = turn
        self._last.move_to_end(session_id)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._last.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._last)
