"""From a request's sampling fields to a :class:`~specroll.actors.server.requests.ServeRequest`, with
every bound checked before anything reaches the hub: a prompt's token ids in the vocabulary, prompt
plus ``max_tokens`` within the context, ``n`` and ``stop`` within the server's limits, sampling
values in range. Each refusal is a 400 naming the field and what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from specroll.actors.server.errors import bad_request
from specroll.actors.server.requests import ServeRequest
from specroll.protocol.limits import MAX_STOP_TOKEN_IDS
from specroll.protocol.sampling import SamplingParams

MAX_STOP_CHARS = 256
"""Longest ``stop`` string accepted."""
MAX_SEED = (1 << 63) - 1


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server."""

    max_model_len: int
    """Prompt plus response tokens at most (the smaller of the model's and the engine's)."""
    vocab_size: int
    max_n: int
    max_stop: int


@dataclass(frozen=True)
class Sampling:
    """The sampling fields a request gave (None: omitted), in vLLM's names."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


def check_prompt(ids: list[int], limits: Limits, param: str = "prompt") -> list[int]:
    """``ids`` if every one is in the vocabulary and some room is left for a response.

    Raises:
        ApiError: 400 for an empty prompt, an id outside ``[0, vocab_size)`` or a prompt of
            ``max_model_len`` tokens or more.
    """
    if not ids:
        raise bad_request(f"{param} is empty; expected at least one token", param=param)
    if len(ids) >= limits.max_model_len:  # first: a million ids are refused without walking them
        raise bad_request(f"the prompt is {len(ids)} tokens; this model's context is {limits.max_model_len} tokens "
                          f"(max_model_len), so at most {limits.max_model_len - 1} leave room for a response",
                          param=param)
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}[{bad}] = {ids[bad]} is not a token id; expected one in [0, {limits.vocab_size})",
                          param=param)
    return ids


def serve_request(prompt_ids: list[int], fields: Sampling, limits: Limits, session_id: str | None = None,
                  default_max_tokens: int | None = None) -> ServeRequest:
    """The request for one prompt (already :func:`check_prompt`-ed).

    ``max_tokens`` omitted: ``default_max_tokens`` if given, else the rest of the context.

    Raises:
        ApiError: 400 naming the field: ``n`` outside ``[1, max_n]``; ``max_tokens`` below 1 or past
            the context with the prompt; more than ``max_stop`` stop strings, an empty or too long one;
            too many or out-of-vocabulary ``stop_token_ids``; a seed outside ``[0, 2**63)``;
            ``temperature``, ``top_p`` or ``top_k`` out of range.
    """
    if not 1 <= fields.n <= limits.max_n:
        raise bad_request(f"n = {fields.n}; expected an integer in [1, {limits.max_n}] (server.max_n)", param="n")
    room = limits.max_model_len - len(prompt_ids)
    max_tokens = fields.max_tokens if fields.max_tokens is not None else default_max_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise bad_request(f"max_tokens = {max_tokens}; expected a positive integer", param="max_tokens")
    elif max_tokens > room:
        raise bad_request(f"the prompt is {len(prompt_ids)} tokens and max_tokens = {max_tokens}: {len(prompt_ids)} + "
                          f"{max_tokens} is past this model's context of {limits.max_model_len} tokens; expected "
                          f"max_tokens <= {room}", param="max_tokens")
    stop = _stop_strings(fields.stop, limits.max_stop)
    stop_ids = fields.stop_token_ids or []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"{len(stop_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
    if any(not 0 <= t < limits.vocab_size for t in stop_ids):
        raise bad_request(f"stop_token_ids must be token ids in [0, {limits.vocab_size})", param="stop_token_ids")
    if fields.seed is not None and not 0 <= fields.seed <= MAX_SEED:
        raise bad_request(f"seed = {fields.seed}; expected an integer in [0, 2**63)", param="seed")
    top_k = fields.top_k if fields.top_k is not None else 0
    if top_k == -1:
        top_k = 0  # vLLM's "no top-k"
    try:
        sampling = SamplingParams(
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_k=top_k, top_p=1.0 if fields.top_p is None else fields.top_p, max_tokens=max_tokens,
            seed=fields.seed, stop_token_ids=tuple(stop_ids), ignore_eos=fields.ignore_eos)
    except ValueError as e:
        param = next((name for name in ("temperature", "top_k", "top_p") if name in str(e)), None)
        raise bad_request(str(e), param=param) from None
    return ServeRequest(list(prompt_ids), fields.n, sampling, stop, fields.skip_special_tokens,
                        fields.include_stop_str_in_output, session_id)


def _stop_strings(stop: str | list[str] | None, max_stop: int) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > max_stop:
        raise bad_request(f"{len(strings)} stop strings; at most {max_stop} (server.max_stop)", param="stop")
    for s in strings:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise bad_request(f"a stop string of {len(s)} characters; expected 1 to {MAX_STOP_CHARS}", param="stop")
    return tuple(strings)
