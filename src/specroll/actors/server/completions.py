"""``POST /v1/completions`` and ``POST /inference/v1/generate``, in vLLM's request and reply shapes.

Completions: ``prompt`` as text, token ids, or a batch of either (one group of ``n`` per prompt;
choice ``i * n + j`` is sample ``j`` of prompt ``i``). Every choice carries ``token_versions`` (the
policy version of each of its tokens) besides vLLM's fields; with ``return_token_ids`` also
``token_ids`` and ``prompt_token_ids`` (on the choice, as vLLM, and at the top level for the first
prompt); with ``logprobs`` OpenAI's legacy ``logprobs`` object (``tokens``, ``token_logprobs``,
``text_offset``, ``top_logprobs`` holding the sampled token only).

Generate: token ids in, token ids out (``{request_id, choices: [{index, token_ids, logprobs:
{content: [{token, logprob}]}, finish_reason, token_versions}], prompt_token_ids}``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from specroll.actors.server.choice_text import ChoiceText
from specroll.actors.server.errors import bad_request
from specroll.actors.server.replies import DONE, chat_logprobs, finite, follow, new_id, now, sse, token_text, usage
from specroll.actors.server.request_fields import Sampling, check_prompt, serve_request
from specroll.actors.server.requests import Generation
from specroll.actors.server.schemas import CompletionRequest, GenerateRequest
from specroll.actors.server.state import ServerState

MAX_BATCH_PROMPTS = 64
"""Most prompts in one completions request (each is a group of ``n``)."""


def _sampling(body: CompletionRequest) -> Sampling:
    return Sampling(body.max_tokens, body.temperature, body.top_p, body.top_k, body.n, body.seed, body.stop,
                    body.stop_token_ids, body.ignore_eos, body.skip_special_tokens, body.include_stop_str_in_output)


def _prompts(state: ServerState, prompt: object) -> list[list[int]]:
    """The request's prompts as token ids (text encoded with the checkpoint's BOS rule)."""
    if isinstance(prompt, str):
        batch: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        batch = [prompt]
    else:
        batch = list(prompt) if isinstance(prompt, list) else []
    if not batch:
        raise bad_request("prompt is empty; expected text, token ids, or a non-empty list of either", param="prompt")
    if len(batch) > MAX_BATCH_PROMPTS:
        raise bad_request(f"{len(batch)} prompts; at most {MAX_BATCH_PROMPTS} in one request", param="prompt")
    if not (all(isinstance(p, str) for p in batch) or all(isinstance(p, list) for p in batch)):
        raise bad_request("prompt mixes token ids, texts and lists; expected text, token ids, a list of texts or "
                          "a list of token id lists", param="prompt")
    out = []
    for i, p in enumerate(batch):
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        out.append(check_prompt(ids, state.limits, "prompt" if len(batch) == 1 else f"prompt[{i}]"))
    return out


async def completions(state: ServerState, body: CompletionRequest,
                      session_id: str | None) -> dict[str, Any] | AsyncIterator[bytes]:
    """Run a completions request: the whole reply, or its server-sent events when ``stream``.

    Raises:
        ApiError: 400 for bad fields (``request_fields``), 404 for another model, 429/503/504 (``Router``).
    """
    state.check_model(body.model)
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise bad_request(f"logprobs = {body.logprobs}; expected an integer in [0, 20]", param="logprobs")
    # In a worker thread: tokenizing megabytes of text takes seconds, which would hold up every other
    # request and the hub.
    prompts = await anyio.to_thread.run_sync(_prompts, state, body.prompt)
    fields = _sampling(body)
    requests = [serve_request(ids, fields, state.limits, session_id) for ids in prompts]
    reply = _Reply(state, body, prompts)
    if body.stream:
        return reply.stream(follow(state.router, requests))
    async for generations in follow(state.router, requests, every_change=False):
        last = generations
    return reply.whole(last)


class _Reply:
    def __init__(self, state: ServerState, body: CompletionRequest, prompts: list[list[int]]) -> None:
        self.state, self.body, self.prompts = state, body, prompts
        self.id, self.created = new_id("cmpl"), now()

    def _choice(self, index: int, prompt: list[int], choice: ChoiceText, text: str, ids: list[int],
                logprobs: list[float], versions: list[int], offset: int) -> dict[str, Any]:
        body = self.body
        out: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                               "finish_reason": choice.finish_reason if choice.finished else None,
                               "stop_reason": choice.stop_reason if choice.finished else None,
                               "token_versions": versions}
        if body.logprobs is not None:
            out["logprobs"] = self._logprobs(ids, logprobs, offset)
        if body.return_token_ids:
            out["token_ids"], out["prompt_token_ids"] = ids, prompt
        return out

    def _logprobs(self, ids: list[int], logprobs: list[float], offset: int) -> dict[str, Any]:
        tokens = [token_text(self.state.tokenizer, t, self.body.return_tokens_as_token_ids) for t in ids]
        lps = [finite(lp) for lp in logprobs]
        offsets, at = [], offset
        for t in ids:
            offsets.append(at)
            at += len(self.state.tokenizer.decode([t], skip_special_tokens=self.body.skip_special_tokens))
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps, strict=True)]}

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.state.model_name}

    def whole(self, generations: list[Generation]) -> dict[str, Any]:
        choices, all_choices = [], []
        for p, (prompt, generation) in enumerate(zip(self.prompts, generations, strict=True)):
            for j, c in enumerate(generation.choices):
                all_choices.append(c)
                choices.append(self._choice(p * len(generation.choices) + j, prompt, c, c.text, c.token_ids,
                                            c.logprobs, c.versions, 0))
        out = {**self._head(), "choices": choices,
               "usage": usage(sum(map(len, self.prompts)), all_choices)}
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompts[0]
        return out

    async def stream(self, updates: AsyncIterator[list[Generation]]) -> AsyncIterator[bytes]:
        all_choices: list[ChoiceText] = []
        async for generations in updates:
            all_choices = [c for g in generations for c in g.choices]
            for p, (prompt, generation) in enumerate(zip(self.prompts, generations, strict=True)):
                for j, c in enumerate(generation.choices):
                    if not c.has_news():
                        continue
                    offset = c.sent_text
                    text = c.sendable_text()
                    ids, logprobs, versions = c.sendable_tokens()
                    c.final_sent = c.finished
                    yield sse({**self._head(), "choices": [
                        self._choice(p * len(generation.choices) + j, prompt, c, text, ids, logprobs, versions,
                                     offset)]})
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield sse({**self._head(), "choices": [], "usage": usage(sum(map(len, self.prompts)), all_choices)})
        yield DONE


async def generate(state: ServerState, body: GenerateRequest,
                   session_id: str | None) -> dict[str, Any] | AsyncIterator[bytes]:
    """Run a generate request (token ids in and out; module docstring).

    Raises:
        ApiError: as :func:`completions`.
    """
    state.check_model(body.model)
    sp = body.sampling_params
    prompt = check_prompt(list(body.token_ids), state.limits, "token_ids")
    fields = Sampling(sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.n, sp.seed, None, sp.stop_token_ids,
                      sp.ignore_eos, sp.skip_special_tokens)
    request = serve_request(prompt, fields, state.limits, session_id)
    request_id = body.request_id if body.request_id and len(body.request_id) <= 256 else new_id("gen")
    want_logprobs = sp.logprobs is not None

    def choice(index: int, c: ChoiceText, ids: list[int], logprobs: list[float], versions: list[int]) -> dict:
        return {"index": index, "token_ids": ids, "token_versions": versions,
                "logprobs": {"content": chat_logprobs(state.tokenizer, ids, logprobs, True, False)}
                if want_logprobs else None,
                "finish_reason": c.finish_reason if c.finished else None}

    if not body.stream:
        async for generations in follow(state.router, [request], every_change=False):
            last = generations[0]
        return {"request_id": request_id, "prompt_token_ids": prompt,
                "choices": [choice(j, c, c.token_ids, c.logprobs, c.versions) for j, c in enumerate(last.choices)]}

    async def events() -> AsyncIterator[bytes]:
        async for generations in follow(state.router, [request]):
            for j, c in enumerate(generations[0].choices):
                if c.has_news():
                    ids, logprobs, versions = c.sendable_tokens()
                    c.final_sent = c.finished
                    yield sse({"request_id": request_id, "choices": [choice(j, c, ids, logprobs, versions)]})
        yield DONE

    return events()
