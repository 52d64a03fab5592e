"""The server's routes (vLLM's paths and shapes) as one Starlette application.

Data plane: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /inference/v1/generate``,
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``. Control plane:
``POST /pause?mode=keep|abort|wait``, ``POST /resume``, ``GET /is_paused``,
``POST /reset_prefix_cache``, ``POST /update_weights``. The manual's "OpenAI-compatible server" page
lists every field and what differs from vLLM.
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specroll.actors.server.chat import chat_completions, chat_prompt
from specroll.actors.server.completions import completions, generate
from specroll.actors.server.errors import ApiError, bad_request
from specroll.actors.server.http import decode, guarded, read_body, reply, session_id
from specroll.actors.server.replies import now
from specroll.actors.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
    refuse_unsupported,
)
from specroll.actors.server.state import ServerState

PAUSE_WAIT_S = 600.0
"""Longest ``/pause?mode=wait`` (seconds) before it answers 504."""


def build_app(state: ServerState) -> Starlette:
    """The application serving ``state`` (its routes: the module docstring)."""
    config = state.config

    async def post_completions(request: Request) -> Response:
        body = decode(await read_body(request, config), CompletionRequest)
        refuse_unsupported(body)
        return await reply(request, completions(state, body, session_id(request)))

    async def post_chat(request: Request) -> Response:
        body = decode(await read_body(request, config), ChatCompletionRequest)
        refuse_unsupported(body)
        return await reply(request, chat_completions(state, body, session_id(request)))

    async def post_generate(request: Request) -> Response:
        body = decode(await read_body(request, config), GenerateRequest)
        return await reply(request, generate(state, body, session_id(request)))

    async def get_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": now(), "owned_by": "specroll",
            "root": state.model_name, "parent": None, "max_model_len": state.limits.max_model_len,
            "policy_versions": state.router.client.generator_versions}]})

    async def get_health(request: Request) -> Response:
        if not state.router.client.coordinator.generators:
            raise ApiError(503, "no generator is connected", code="no_generator", retry_after_s=5)
        return Response(status_code=200)

    async def post_tokenize(request: Request) -> Response:
        body = decode(await read_body(request, config), TokenizeRequest)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("expected exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                         add_generation_prompt=body.add_generation_prompt,
                                         chat_template_kwargs=body.chat_template_kwargs)
            ids = (await anyio.to_thread.run_sync(chat_prompt, state, chat)).ids  # off the loop, as completions
        else:
            ids = await anyio.to_thread.run_sync(state.tokenizer.encode, body.prompt or "", body.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.limits.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [state.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return JSONResponse(out)

    async def post_detokenize(request: Request) -> Response:
        body = decode(await read_body(request, config), DetokenizeRequest)
        state.check_model(body.model)
        ids = body.tokens
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < state.limits.vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens[{bad}] = {ids[bad]} is not a token id; expected one in "
                              f"[0, {state.limits.vocab_size})", param="tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)})

    async def post_pause(request: Request) -> Response:
        mode = request.query_params.get("mode", "keep")
        if mode not in ("keep", "abort", "wait"):
            raise bad_request(f"mode={mode[:40]!r}; expected keep, abort or wait", param="mode")
        try:
            await state.router.pause(mode, PAUSE_WAIT_S)  # type: ignore[arg-type]
        except TimeoutError:
            raise ApiError(504, f"requests in flight did not finish within {PAUSE_WAIT_S} s; the server stays "
                           "paused", code="timeout") from None
        return JSONResponse({"paused": True, "mode": mode})

    async def post_resume(request: Request) -> Response:
        state.router.resume()
        return JSONResponse({"paused": False})

    async def get_is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": state.router.paused})

    async def post_reset_prefix_cache(request: Request) -> Response:
        generators = len(state.router.client.coordinator.generators)
        reset = await state.router.client.reset_prefix_cache()
        return JSONResponse({"generators_reset": reset, "generators": generators})

    async def post_update_weights(request: Request) -> Response:
        body = decode(await read_body(request, config), UpdateWeightsRequest)
        if state.update_weights is None:
            raise ApiError(409, "this server runs beside specroll's trainer, which owns the policy's weights; "
                           "run `specroll serve` to update them over HTTP", code="trainer_owns_policy")
        version = await state.update_weights(body.path, body.version)
        return JSONResponse({"policy_version": version})

    routes = [
        ("/v1/completions", post_completions, "POST"), ("/v1/chat/completions", post_chat, "POST"),
        ("/inference/v1/generate", post_generate, "POST"), ("/v1/models", get_models, "GET"),
        ("/tokenize", post_tokenize, "POST"), ("/detokenize", post_detokenize, "POST"),
        ("/pause", post_pause, "POST"), ("/resume", post_resume, "POST"), ("/is_paused", get_is_paused, "GET"),
        ("/reset_prefix_cache", post_reset_prefix_cache, "POST"), ("/update_weights", post_update_weights, "POST"),
    ]
    app = Starlette(routes=[Route(path, guarded(fn, config), methods=[method]) for path, fn, method in routes]
                    + [Route("/health", guarded(get_health, config, public=True), methods=["GET"])])

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        e = ApiError(status, f"{request.method} {request.url.path[:200]} is not a route of this server"
                     if status == 404 else f"{request.method} is not allowed on {request.url.path[:200]}")
        return JSONResponse(e.body(), status_code=status, headers=getattr(exc, "headers", None))  # 405: Allow

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_found)
    return app


async def wait_ready(state: ServerState, count: int, timeout_s: float) -> None:
    """Wait until ``count`` generators are connected (``specroll serve`` before it says it is up).

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    with anyio.fail_after(timeout_s):
        await state.router.client.wait_for_generators(count)
