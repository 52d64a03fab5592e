"""Tool calls out of generated text, whole or streamed, in the Hermes/Qwen format.

A model trained on the Hermes format (Qwen2.5/Qwen3, Hermes 2 Pro/3, and any model prompted with
:func:`tools_system_prompt`) answers a tool call with blocks such as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Parsing never loses text. A block counts as a call when its body is a JSON object with a ``name``
among the request's tools and an optional ``arguments`` object, and no other key; any other block
(not JSON, no or an unknown name, arguments not an object, extra keys, or a ``<tool_call>`` never
closed) is counted in ``parse_errors`` and kept, raw, in ``content``. ``content`` is the text outside
the calls: all of the text before the first block, then, in order, each bad block and each later
stretch of text that is not only whitespace (the newlines between blocks are dropped); ``None`` when
that is empty or whitespace. The streaming parser produces the same result from any split of the
text into deltas.

Sources: the format as Qwen2.5-Instruct's chat template writes it (``tool_prompt.py``); the result
shapes as OpenAI's Chat Completions API returns them (``message.tool_calls`` and, streamed,
``choices[].delta.tool_calls``); vLLM's ``hermes_tool_parser.py`` does the same job (it drops bad
blocks and text after the first block, which this one keeps).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from specroll.actors.server.tool_prompt import hermes_fallback_messages, template_uses_tools, tools_system_prompt

__all__ = [
    "TOOL_PARSERS",
    "HermesToolCallStream",
    "HermesToolParser",
    "ParsedToolCalls",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallIds",
    "ToolCallStream",
    "ToolParser",
    "choose_tool_parser",
    "hermes_fallback_messages",
    "template_uses_tools",
    "tools_system_prompt",
]

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: ``arguments`` is a JSON object's text, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """The ``message.tool_calls[]`` entry of a Chat Completions response."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedToolCalls:
    """A whole generation split into message content and tool calls (see the module docstring)."""

    content: str | None
    tool_calls: list[ToolCall]
    parse_errors: int


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed tool call, whole: this parser emits a call once its ``</tool_call>`` closes, so
    the first delta of a call carries its id, name and all of its arguments (OpenAI's clients join
    argument fragments, of which this is the one)."""

    index: int
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """The ``choices[].delta.tool_calls[]`` entry of a streamed Chat Completions chunk."""
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one fed text delta released: content text (``""`` for none) and completed calls."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallIds:
    """Tool call ids ``call_<24 hex digits>`` (96 random bits, OpenAI's shape) drawn from ``rng``;
    seed it for deterministic ids. ``None`` draws from the operating system (``random.SystemRandom``)."""

    def __init__(self, rng: random.Random | None = None, prefix: str = "call_") -> None:
        self._rng = rng if rng is not None else random.SystemRandom()
        self._prefix = prefix

    def __call__(self) -> str:
        return f"{self._prefix}{self._rng.getrandbits(96):024x}"


class ToolCallStream(Protocol):
    """An incremental parser for one generation: :meth:`feed` deltas in order, then :meth:`finish`."""

    def feed(self, text: str) -> StreamDelta:
        """Take the next text delta; return what can be released without knowing what follows."""
        ...

    def finish(self) -> StreamDelta:
        """The generation ended: release what was held back."""
        ...

    def result(self) -> ParsedToolCalls:
        """Everything released, as the whole-text parse would give it (after :meth:`finish`)."""
        ...


class ToolParser(Protocol):
    """A tool call format: whole-text and streaming parsers for it."""

    name: str

    def parse(self, text: str, tool_names: Collection[str], new_id: Callable[[], str]) -> ParsedToolCalls:
        """Split a whole generation into content and calls; ``new_id`` names each call in order."""
        ...

    def stream(self, tool_names: Collection[str], new_id: Callable[[], str]) -> ToolCallStream:
        """A streaming parser whose result equals :meth:`parse` of the concatenated deltas."""
        ...


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (module docstring)."""

    name = "hermes"

    def parse(self, text: str, tool_names: Collection[str], new_id: Callable[[], str]) -> ParsedToolCalls:
        """Split ``text`` into content and calls (module docstring); ``new_id`` is called once per
        call, in order."""
        names = frozenset(tool_names)
        kept: list[str] = []  # content pieces, in order
        calls: list[ToolCall] = []
        errors = 0
        pos, after_block = 0, False
        while True:
            start = text.find(OPEN_TAG, pos)
            stretch = text[pos:] if start < 0 else text[pos:start]
            if not after_block or stretch.strip():  # all text before the first block is content
                kept.append(stretch)
            if start < 0:
                break
            end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
            block_end = len(text) if end < 0 else end + len(CLOSE_TAG)
            call = None if end < 0 else _parse_block(text[start + len(OPEN_TAG) : end], names)
            if call is None:
                errors += 1
                kept.append(text[start:block_end])
            else:
                calls.append(ToolCall(new_id(), *call))
            pos, after_block = block_end, True
        content = "".join(kept)
        return ParsedToolCalls(content if content.strip() else None, calls, errors)

    def stream(self, tool_names: Collection[str], new_id: Callable[[], str]) -> HermesToolCallStream:
        """A :class:`HermesToolCallStream` for one generation."""
        return HermesToolCallStream(tool_names, new_id)


class HermesToolCallStream:
    """Streaming :class:`HermesToolParser`: content is released as soon as it cannot be part of a
    block, a call once its ``</tool_call>`` closes (whole, in one :class:`ToolCallDelta`).

    Held back until the next delta decides them: a tail that may begin ``<tool_call>`` (``"<to"``),
    so no part of a tag leaks into content; whitespace before the content's first visible character
    (``None`` content streams nothing); whitespace after a block until visible text follows (the
    newlines between blocks are not content). The concatenated content deltas equal the final
    ``content`` (``""`` for ``None``).
    """

    def __init__(self, tool_names: Collection[str], new_id: Callable[[], str]) -> None:
        self._names = frozenset(tool_names)
        self._new_id = new_id
        self._buffer = ""  # outside a block: an undecided tail; inside: the block's body so far
        self._scanned = 0  # inside a block: how much of the buffer is known to hold no CLOSE_TAG
        self._in_block = False
        self._after_block = False  # a block has been seen: whitespace-only stretches are dropped
        self._lead = ""  # whitespace before the first visible content (kept if any content follows)
        self._gap = ""  # whitespace after a block, kept only if visible text follows before the next
        self._visible = False  # the current stretch has released visible text: release as it comes
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._errors = 0
        self._finished = False

    def feed(self, text: str) -> StreamDelta:
        """Take the next text delta (module docstring for what is released).

        Raises:
            RuntimeError: after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("feed() after finish(): the generation already ended")
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._in_block:
                start = self._buffer.find(OPEN_TAG)
                if start < 0:
                    held = _partial_tag_length(self._buffer)
                    content.append(self._text(self._buffer[: len(self._buffer) - held]))
                    self._buffer = self._buffer[len(self._buffer) - held :]
                    break
                content.append(self._text(self._buffer[:start]))
                self._buffer = self._buffer[start + len(OPEN_TAG) :]
                self._start_block()
                continue
            end = self._buffer.find(CLOSE_TAG, self._scanned)
            if end < 0:
                self._scanned = max(0, len(self._buffer) - len(CLOSE_TAG) + 1)
                break
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG) :]
            self._in_block = False
            call = _parse_block(body, self._names)
            if call is None:
                content.append(self._bad_block(OPEN_TAG + body + CLOSE_TAG))
            else:
                deltas.append(self._call(*call))
        return self._released(content, deltas)

    def finish(self) -> StreamDelta:
        """The generation ended: release the held tail (an unclosed ``<tool_call>`` is a bad block,
        a partial tag is content); trailing whitespace the whole parse drops stays unreleased.

        Raises:
            RuntimeError: called twice.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        tail, self._buffer = self._buffer, ""
        content = self._bad_block(OPEN_TAG + tail) if self._in_block else self._text(tail)
        return self._released([content], [])

    def result(self) -> ParsedToolCalls:
        """Everything released: equal to :meth:`HermesToolParser.parse` of the whole text.

        Raises:
            RuntimeError: before :meth:`finish`.
        """
        if not self._finished:
            raise RuntimeError("result() before finish(): the generation may not be over")
        content = "".join(self._content)
        return ParsedToolCalls(content or None, list(self._calls), self._errors)

    def _text(self, text: str) -> str:
        """Content text of the current stretch: what of it (and of held whitespace) to release."""
        if self._visible:
            return text
        if not text.strip():
            if self._after_block:
                self._gap += text
            else:
                self._lead += text
            return ""
        released, self._lead, self._gap = self._lead + self._gap + text, "", ""
        self._visible = True
        return released

    def _start_block(self) -> None:
        self._in_block, self._after_block = True, True
        self._scanned, self._gap, self._visible = 0, "", False

    def _bad_block(self, raw: str) -> str:
        self._errors += 1
        released, self._lead = self._lead + raw, ""
        return released

    def _call(self, name: str, arguments: str) -> ToolCallDelta:
        call = ToolCall(self._new_id(), name, arguments)
        self._calls.append(call)
        return ToolCallDelta(len(self._calls) - 1, call.id, call.name, call.arguments)

    def _released(self, content: list[str], deltas: list[ToolCallDelta]) -> StreamDelta:
        text = "".join(content)
        if text:
            self._content.append(text)
        return StreamDelta(text, deltas)


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": HermesToolParser()}
"""Tool call formats by the name ``server.tool_parser`` gives them."""


def choose_tool_parser(setting: str, chat_template: str | None) -> ToolParser | None:
    """The parser for a model: ``setting`` (``server.tool_parser``) names one of
    :data:`TOOL_PARSERS`, or is ``"auto"``: then a template that writes ``<tool_call>`` gets
    ``hermes``, and so does one that never reads ``tools`` (or no template), since the server then
    prompts with :func:`tools_system_prompt`, a Hermes prompt. ``None`` when ``"auto"`` meets a
    template that renders tools in a format no parser here reads (e.g. Llama 3.1's
    ``<|python_tag|>``): the server should refuse requests with tools, naming ``server.tool_parser``.

    Raises:
        ValueError: ``setting`` is neither ``"auto"`` nor a name in :data:`TOOL_PARSERS`.
        CheckpointError: the template does not parse (``"auto"`` only).
    """
    if setting != "auto":
        if setting not in TOOL_PARSERS:
            raise ValueError(
                f"server.tool_parser={setting!r} is not a known tool parser; expected 'auto' or one of "
                f"{', '.join(map(repr, sorted(TOOL_PARSERS)))}"
            )
        return TOOL_PARSERS[setting]
    if chat_template is None or OPEN_TAG in chat_template or not template_uses_tools(chat_template):
        return TOOL_PARSERS["hermes"]
    return None


def _parse_block(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a block body that is a call to one of ``names``, else ``None``."""
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; so is a NaN/Infinity
        return None
    if not isinstance(value, dict) or not value.keys() <= {"name", "arguments"}:
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _reject_constant(constant: str) -> Any:
    # json.loads accepts NaN and Infinity, which are not JSON: a client could not parse them back.
    raise ValueError(f"{constant} is not JSON")


def _partial_tag_length(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if text.endswith(OPEN_TAG[:length]):
            return length
    return 0
