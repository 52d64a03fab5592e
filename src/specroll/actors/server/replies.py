"""What the completion, chat and generate routes share: following one or more generations at once,
logprob entries, usage, server-sent events and response ids (vLLM's and OpenAI's shapes)."""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from specroll.actors.server.choice_text import ChoiceText
from specroll.actors.server.errors import ApiError
from specroll.actors.server.requests import Generation, Router, ServeRequest, Wake
from specroll.engine.loaders.tokenizer import Tokenizer

_ENCODER = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    """A response id: ``prefix-<32 hex digits>`` (``cmpl``, ``chatcmpl``, ``gen``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + _ENCODER.encode(event) + b"\n\n"


def encode(body: dict[str, Any]) -> bytes:
    return _ENCODER.encode(body)


def usage(prompt_tokens: int, choices: Sequence[ChoiceText]) -> dict[str, int]:
    """OpenAI's ``usage``: prompt tokens counted once per prompt, completion tokens over all choices."""
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def token_text(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    """A token as ``logprobs`` names it: its text (special tokens included) or ``"token_id:N"``."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id], skip_special_tokens=False)


def finite(logprob: float) -> float:
    """JSON has no -inf: a logprob of a token impossible under the processed distribution (it can
    only be the bonus of a greedy step) is sent as -9999.0, as vLLM does."""
    return logprob if math.isfinite(logprob) else -9999.0


def chat_logprobs(tokenizer: Tokenizer, ids: Sequence[int], logprobs: Sequence[float], as_ids: bool,
                  top: bool) -> list[dict[str, Any]]:
    """``logprobs.content`` entries (chat and generate): the sampled token's logprob under the
    processed distribution; ``top_logprobs`` holds that token alone (no alternatives are kept)."""
    out = []
    for token_id, logprob in zip(ids, logprobs, strict=True):
        token = token_text(tokenizer, token_id, as_ids)
        entry: dict[str, Any] = {"token": token, "logprob": finite(logprob), "bytes": list(token.encode())}
        if top:
            entry["top_logprobs"] = [{"token": token, "logprob": finite(logprob), "bytes": entry["bytes"]}]
        out.append(entry)
    return out


async def follow(router: Router, requests: Sequence[ServeRequest],
                 every_change: bool = True) -> AsyncIterator[list[Generation]]:
    """Run ``requests`` on the hub at once; yield all their generations now and after every change,
    until each finished (a group whose choices all met a stop string is ended early on its
    generator). Closing the iterator early (the client went away) aborts the unfinished ones.

    ``every_change=False`` (a whole reply, which reads only the last yield): the choices are fed in
    the hub's chunk callback, chunk by chunk as before (so the text is built exactly as when
    streamed), and the follower wakes only when a generation finished — not once per chunk.

    Raises:
        ApiError: from :meth:`Router.run` (429, 503) for any of them, 400 when a generator refused
            one (a limit of its own, e.g. a shorter ``--max-model-len``), 503 when the hub dropped one
            (its group refused or lost more than ``trainer.max_group_retries`` times), or 504 past the deadline.
    """
    async with contextlib.AsyncExitStack() as stack:
        generations = [await stack.enter_async_context(router.run(r)) for r in requests]
        deadline = router.deadline()
        wake = Wake()
        for generation in generations:
            generation.on_change = wake.set if every_change else _wake_when_finished(generation, wake)
        while True:
            for generation in generations:
                generation.sync()
                if generation.group.refused is not None:  # past a limit of the generator's the server did not know
                    raise ApiError(400, f"the generator refused this request: {generation.group.refused}",
                                   code="refused_by_generator")
                if (dropped := generation.group.dropped) is not None:  # it kept failing on the generators
                    raise ApiError(503, f"this request kept failing on the generators: {dropped.describe()}",
                                   code="group_dropped")
                if generation.finished:
                    await router.end_early(generation)
            yield generations
            if all(g.finished for g in generations):
                return
            await wake.wait(deadline)


def _wake_when_finished(generation: Generation, wake: Wake) -> Callable[[], None]:
    def on_change() -> None:
        try:
            generation.sync()
        except Exception:  # not in the hub's callback: the follower syncs again and meets it itself
            wake.set()
            return
        if generation.finished or generation.group.dropped is not None:
            wake.set()

    return on_change
