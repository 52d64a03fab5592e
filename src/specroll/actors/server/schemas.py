"""The request bodies the server takes, as typed msgspec structs in vLLM's field names (its
``CompletionRequest``, ``ChatCompletionRequest`` and ``GenerateRequest``).

Fields a client library sends that change nothing here (``user``, ``parallel_tool_calls``,
``stream_options`` beyond ``include_usage``...) are accepted and ignored, as vLLM does; a field the
server knows but cannot honour with a non-default value (``frequency_penalty``, ``logit_bias``,
``echo``...) is a 400 naming it, never silently ignored (:func:`refuse_unsupported`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from specroll.actors.server.errors import bad_request


class _Body(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """A request body: unknown fields are ignored."""


class StreamOptions(_Body, kw_only=True):
    include_usage: bool = False
    """Send a last chunk with ``usage`` (and ``choices: []``) before ``[DONE]``."""


class _Sampling(_Body, kw_only=True):
    """The sampling fields completions and chat share (OpenAI's defaults; vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    """Response tokens at most; None (omitted): the rest of the context, not 16."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """0 or -1: no top-k filter."""
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    """Top-level ``prompt_token_ids`` and each choice's ``token_ids``."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Known, honoured only at their defaults:
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: Any = None
    structured_outputs: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list[int | str | list[int]]
    """Text, token ids, or a batch of either (one group of ``n`` per prompt; choice ``i * n + j``)."""
    logprobs: int | None = None
    """Return each token's logprob (``logprobs.tokens``, ``token_logprobs``); ``top_logprobs`` lists
    only the sampled token whatever the number (the engine keeps no alternatives)."""
    return_tokens_as_token_ids: bool = False
    """``logprobs.tokens`` as ``"token_id:N"``."""
    echo: bool = False
    suffix: str | None = None


class ToolCallFunction(_Body, kw_only=True):
    name: str
    arguments: str = ""


class ToolCall(_Body, kw_only=True):
    id: str = ""
    type: str = "function"
    function: ToolCallFunction


class Message(_Body, kw_only=True):
    """One chat message. ``content`` may be a string, a list of ``{"type": "text", "text": ...}``
    parts, or None (an assistant turn that only calls tools)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    """OpenAI's newer name for ``max_tokens``; the smaller wins when both are given."""
    logprobs: bool = False
    top_logprobs: int | None = None
    """Accepted; ``top_logprobs`` lists only the sampled token (the engine keeps no alternatives)."""
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False


class GenerateSamplingParams(_Body, kw_only=True):
    """``sampling_params`` of ``POST /inference/v1/generate`` (vLLM's ``SamplingParams`` names)."""

    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0


class GenerateRequest(_Body, kw_only=True):
    """``POST /inference/v1/generate``: token ids in, token ids out."""

    token_ids: list[int]
    model: str | None = None
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    cache_salt: str | None = None
    request_id: str | None = None


class TokenizeRequest(_Body, kw_only=True):
    """``POST /tokenize``: ``prompt`` text, or chat ``messages`` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body, kw_only=True):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None
    skip_special_tokens: bool = False
    """Drop control tokens from the text (an extension; vLLM's keeps them)."""


class UpdateWeightsRequest(_Body, kw_only=True):
    """``POST /update_weights``: a folder of safetensors to publish as the next policy version."""

    path: str
    version: int | None = None
    """The policy version to publish it as; None: one above the current."""


_DEFAULTS: dict[str, object] = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                "min_tokens": 0, "min_p": 0.0, "logit_bias": None, "use_beam_search": False,
                                "guided_json": None, "guided_regex": None, "guided_choice": None,
                                "guided_grammar": None, "response_format": None, "structured_outputs": None,
                                "echo": False, "suffix": None, "continue_final_message": False}
_WHY = {"guided_json": "no grammar-constrained sampling: the trainer must see the distribution that was sampled",
        "response_format": "no grammar-constrained sampling: the trainer must see the distribution that was sampled"}


def refuse_unsupported(body: msgspec.Struct) -> None:
    """Raise a 400 for a field the server cannot honour at the value given (module docstring).

    Raises:
        ApiError: naming the field, its value and the value it supports.
    """
    for name, default in _DEFAULTS.items():
        value = getattr(body, name, default)
        if value != default and not (name == "logit_bias" and not value) \
                and not (name == "response_format" and _plain_text(value)):
            why = _WHY.get(name, "not supported by specroll's server")
            raise bad_request(f"{name}={_shown(value)} is not supported ({why}); expected {default!r} or omitted",
                              param=name)
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != getattr(body, "n", 1):
        raise bad_request(f"best_of={best_of} is not supported; expected omitted or equal to n", param="best_of")


def _plain_text(value: object) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
