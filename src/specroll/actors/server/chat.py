"""``POST /v1/chat/completions``: messages through the model's chat template, tools, tool calls
parsed out of the reply, in OpenAI's and vLLM's shapes.

``tools`` are validated (``tool_schema``); a template that renders them gets them, one that ignores
them (SmolLM2's) gets the Hermes tools prompt written into the messages (``tool_prompt``). With
``tool_choice`` ``auto`` (the default with tools) the reply's ``<tool_call>`` blocks become
``message.tool_calls`` and the finish reason ``tool_calls``; ``none`` leaves the text as content.
Sampling is never constrained: the trainer must see the distribution that was sampled. Every choice
carries ``token_versions``; with ``return_token_ids`` also ``token_ids``, and the reply
``prompt_token_ids``; with ``logprobs`` each token's logprob in ``logprobs.content``.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from specroll.actors.server.choice_text import ChoiceText
from specroll.actors.server.errors import bad_request
from specroll.actors.server.replies import DONE, chat_logprobs, follow, new_id, now, sse, usage
from specroll.actors.server.request_fields import Sampling, check_prompt, serve_request
from specroll.actors.server.requests import Generation
from specroll.actors.server.schemas import ChatCompletionRequest, Message
from specroll.actors.server.state import ServerState
from specroll.actors.server.stitch import ChatTurn, continuation_ids, reply_key
from specroll.actors.server.tool_calls import ToolCallIds, ToolCallStream
from specroll.actors.server.tool_prompt import hermes_fallback_messages
from specroll.actors.server.tool_schema import ToolSchemaError, validate_tool_choice, validate_tools
from specroll.engine.loaders.chat_template import ChatTemplateError
from specroll.rl.episodes import Turn


def _message(message: Message, index: int) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(message)
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content[{j}] is a {part.get('type')!r} part; only text parts "
                                  "are supported", param=f"messages[{index}].content")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    if message.role not in ("system", "user", "assistant", "tool", "developer"):
        raise bad_request(f"messages[{index}].role = {message.role!r}; expected system, user, assistant, tool or "
                          "developer", param=f"messages[{index}].role")
    return out


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt: its token ids, the tools its reply may call, and what a session
    keeps of the turn (``stitch.py``)."""

    ids: list[int]
    tool_names: list[str]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    template_kwargs: dict[str, Any] | None
    stitched: bool


def chat_prompt(state: ServerState, body: ChatCompletionRequest, session_id: str | None = None) -> ChatPrompt:
    """The prompt of a chat request: its messages rendered by the chat template, or, for a session
    whose last turn it continues, that turn's tokens and the new messages' (``stitch.py``).

    Raises:
        ApiError: 400 for no messages, a bad message, tools or tool_choice, a template that fails on
            the messages, or tools with no parser for this model (``server.tool_parser``).
    """
    if not body.messages:
        raise bad_request("messages is empty; expected at least one message", param="messages")
    try:
        tools = validate_tools(body.tools)
        choice = validate_tool_choice(body.tool_choice, has_tools=bool(tools))
    except ToolSchemaError as e:
        raise bad_request(str(e), param=e.param) from None
    if tools and state.tool_parser is None:
        raise bad_request("this model's chat template writes tool calls in a format no tool parser here reads; set "
                          "server.tool_parser = 'hermes' if the model answers in <tool_call> blocks", param="tools")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    tool_dicts = [t.as_openai() for t in tools]
    render = _renderer(state, messages, tool_dicts, body.chat_template_kwargs)
    tool_names = [t.name for t in tools] if choice == "auto" else []
    transcripts = state.router.transcripts
    last = transcripts.get(session_id) if session_id is not None and (body.n or 1) == 1 else None
    try:
        if last is not None:
            ids, outcome = continuation_ids(last, messages, tool_dicts, body.chat_template_kwargs, render,
                                            state.tokenizer)
            transcripts.outcomes[outcome] += 1
            if ids is not None:
                return ChatPrompt(check_prompt(ids, state.limits, "messages"), tool_names, messages, tool_dicts,
                                  body.chat_template_kwargs, True)
        ids = state.tokenizer.encode(render(messages, body.add_generation_prompt), add_special_tokens=False)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    except ValueError as e:
        raise bad_request(str(e), param="chat_template_kwargs") from None
    return ChatPrompt(check_prompt(ids, state.limits, "messages"), tool_names, messages, tool_dicts,
                      body.chat_template_kwargs, False)


def _renderer(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
              template_kwargs: dict[str, Any] | None) -> Callable[[list[dict[str, Any]], bool], str]:
    """Messages → the template's text, as this request renders them: the template's own tools, or
    the Hermes fallback written into the messages (decided once, on the whole request)."""
    uses_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    fallback = not state.template_reads_tools and bool(tools or uses_tool_turns)

    def render(some: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if fallback:
            some = hermes_fallback_messages(some, tools)
        return state.tokenizer.apply_chat_template(some, add_generation_prompt,
                                                   tools=None if fallback else tools or None,
                                                   chat_template_kwargs=template_kwargs)

    return render


async def chat_completions(state: ServerState, body: ChatCompletionRequest,
                           session_id: str | None) -> dict[str, Any] | AsyncIterator[bytes]:
    """Run a chat request: the whole reply, or its server-sent events when ``stream``.

    Raises:
        ApiError: 400/404 for bad input (:func:`chat_prompt`, ``request_fields``), 429/503/504 (``Router``).
    """
    state.check_model(body.model)
    if (limit := state.router.episodes.full(session_id)) is not None:
        raise bad_request(f"the episode of session {session_id!r} took its {limit} turns (task.max_turns); "
                          "no more requests run in it", param="X-Session-ID")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise bad_request(f"top_logprobs = {body.top_logprobs}; expected an integer in [0, 20]", param="top_logprobs")
    chat = await anyio.to_thread.run_sync(chat_prompt, state, body, session_id)  # off the loop, as completions
    prompt = chat.ids
    limits = [v for v in (body.max_tokens, body.max_completion_tokens) if v is not None]
    fields = Sampling(min(limits) if limits else None, body.temperature, body.top_p, body.top_k, body.n, body.seed,
                      body.stop, body.stop_token_ids, body.ignore_eos, body.skip_special_tokens,
                      body.include_stop_str_in_output)
    request = serve_request(prompt, fields, state.limits, session_id)
    reply = _ChatReply(state, body, chat, session_id)
    if body.stream:
        return _chat_events(reply, follow(state.router, [request]))
    async for generations in follow(state.router, [request], every_change=False):
        last = generations[0]
    return reply.whole(last)


class _ChatReply:
    def __init__(self, state: ServerState, body: ChatCompletionRequest, chat: ChatPrompt,
                 session_id: str | None) -> None:
        self.state, self.body, self.chat, self.session_id = state, body, chat, session_id
        self.prompt, self.tool_names = chat.ids, chat.tool_names
        self.id, self.created = new_id("chatcmpl"), now()
        self.new_call_id = ToolCallIds()
        self.started = anyio.current_time()

    def remember(self, choice: ChoiceText, content: str | None, tool_calls: list[dict[str, Any]],
                 parse_errors: int) -> None:
        """A session's one-choice turn ended: keep it for the next turn's prompt (``stitch.py``) and
        in its episode, if one is open (``episode_log.py``)."""
        if self.session_id is None or len(self.body.messages) == 0 or (self.body.n or 1) != 1:
            return
        router = self.state.router
        router.transcripts.record(self.session_id, ChatTurn(
            self.chat.messages, self.chat.tools, self.chat.template_kwargs, array("q", self.prompt),
            array("q", choice.token_ids), reply_key(content, tool_calls)))
        router.episodes.add(self.session_id, Turn(
            list(self.prompt), list(choice.token_ids), list(choice.logprobs), list(choice.versions),
            choice.finish_reason, len(tool_calls), parse_errors, anyio.current_time() - self.started))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name}

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return {"content": chat_logprobs(self.state.tokenizer, ids, logprobs, False, True)}

    def _finish(self, choice: ChoiceText, called: bool) -> str | None:
        if not choice.finished:
            return None
        return "tool_calls" if called and choice.finish_reason == "stop" else choice.finish_reason

    def whole(self, generation: Generation) -> dict[str, Any]:
        parser = self.state.tool_parser
        choices = []
        for j, c in enumerate(generation.choices):
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "tool_calls": [],
                                       "reasoning_content": None}
            errors = 0
            if self.tool_names and parser is not None:
                parsed = parser.parse(c.text, self.tool_names, self.new_call_id)
                message["content"] = parsed.content
                message["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
                errors = parsed.parse_errors
            if len(generation.choices) == 1:
                self.remember(c, message["content"], message["tool_calls"], errors)
            out: dict[str, Any] = {"index": j, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                                   "finish_reason": self._finish(c, bool(message["tool_calls"])),
                                   "stop_reason": c.stop_reason, "token_versions": c.versions}
            if self.body.return_token_ids:
                out["token_ids"] = c.token_ids
            choices.append(out)
        reply = {**self._head("chat.completion"), "choices": choices,
                 "usage": usage(len(self.prompt), generation.choices)}
        if self.body.return_token_ids:
            reply["prompt_token_ids"] = self.prompt
        return reply


async def _chat_events(reply: _ChatReply, updates: AsyncIterator[list[Generation]]) -> AsyncIterator[bytes]:
    """The reply's server-sent events: a first chunk with the role, then content, tool-call and
    token deltas per choice, its finish reason, ``usage`` when asked, ``[DONE]``."""
    parser = reply.state.tool_parser
    streams: list[ToolCallStream | None] = []
    calls: list[int] = []
    head = reply._head("chat.completion.chunk")
    generation: Generation | None = None
    async for generations in updates:
        generation = generations[0]
        if not streams:
            streams = [parser.stream(reply.tool_names, reply.new_call_id) if reply.tool_names and parser else None
                       for _ in generation.choices]
            calls = [0] * len(generation.choices)
            first: dict[str, Any] = {**head, "choices": [
                {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for j in range(len(generation.choices))]}
            if reply.body.return_token_ids:
                first["prompt_token_ids"] = reply.prompt
            yield sse(first)
        for j, c in enumerate(generation.choices):
            if not c.has_news():
                continue
            text = c.sendable_text()
            ids, logprobs, versions = c.sendable_tokens()
            stream = streams[j]
            delta: dict[str, Any] = {}
            if stream is None:
                if text:
                    delta["content"] = text
            else:
                released = [stream.feed(text)] if text else []
                if c.finished:
                    released.append(stream.finish())
                content = "".join(r.content for r in released)
                tool_calls = [d.as_openai() for r in released for d in r.tool_calls]
                calls[j] += len(tool_calls)
                if content:
                    delta["content"] = content
                if tool_calls:
                    delta["tool_calls"] = tool_calls
            c.final_sent = c.finished
            event: dict[str, Any] = {"index": j, "delta": delta, "logprobs": reply._logprobs(ids, logprobs),
                                     "finish_reason": reply._finish(c, calls[j] > 0),
                                     "stop_reason": c.stop_reason if c.finished else None, "token_versions": versions}
            if reply.body.return_token_ids:
                event["token_ids"] = ids
            yield sse({**head, "choices": [event]})
    if generation is not None and len(generation.choices) == 1 and generation.choices[0].finished:
        choice, stream = generation.choices[0], streams[0]
        if stream is None:
            reply.remember(choice, choice.text, [], 0)
        else:
            result = stream.result()
            reply.remember(choice, result.content, [c.as_openai() for c in result.tool_calls], result.parse_errors)
    options = reply.body.stream_options
    if options is not None and options.include_usage and generation is not None:
        yield sse({**head, "choices": [], "usage": usage(len(reply.prompt), generation.choices)})
    yield DONE
