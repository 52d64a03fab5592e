"""The HTTP layer under every route: the API key, bounded body reading, typed decoding, OpenAI
error bodies, and streams that end (and abort their request) when the client goes away.

Starlette on uvicorn (vLLM's own stack: ASGI, h11) carries the requests; msgspec structs validate
them (already the wire codec's library; decoding and checking in one pass, several times faster
than pydantic for these bodies).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from specroll.actors.config.server_section import ServerConfig
from specroll.actors.server.errors import ApiError, bad_request
from specroll.actors.server.sessions import MAX_SESSION_ID_CHARS

log = logging.getLogger("specroll.server")

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]
_PATH = re.compile(r"at `\$\.?([^`]*)`")


def check_key(request: Request, config: ServerConfig) -> None:
    """``Authorization: Bearer KEY`` when ``server.api_key`` is set (compared in constant time).

    Raises:
        ApiError: 401 for a missing or wrong key (the key is never echoed).
    """
    if not config.api_key:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
        raise ApiError(401, "a missing or wrong API key; send Authorization: Bearer <server.api_key>",
                       code="invalid_api_key")


async def read_body(request: Request, config: ServerConfig) -> bytes:
    """The whole body, at most ``server.max_body_bytes``, within ``server.body_timeout_s``.

    Raises:
        ApiError: 413 past the size (from ``Content-Length`` before reading, or while reading), 408
            when the client sends it too slowly.
    """
    limit = config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; at most {limit} (server.max_body_bytes)",
                       code="body_too_large")
    parts, size = [], 0
    try:
        with anyio.fail_after(config.body_timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise ApiError(413, f"the body is over {limit} bytes (server.max_body_bytes)",
                                   code="body_too_large")
                parts.append(part)
    except TimeoutError:
        raise ApiError(408, f"the body was not received within {config.body_timeout_s} s (server.body_timeout_s)",
                       code="body_timeout") from None
    return b"".join(parts)


def decode(body: bytes, kind: type[T]) -> T:
    """``body`` as a ``kind`` struct.

    Raises:
        ApiError: 400 for malformed JSON or a field of the wrong type (naming it).
    """
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        match = _PATH.search(str(e))
        raise bad_request(f"invalid request: {e}", param=match.group(1) if match else None) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}", param=None) from None


def session_id(request: Request) -> str | None:
    """The ``X-Session-ID`` header, if any.

    Raises:
        ApiError: 400 for one longer than :data:`MAX_SESSION_ID_CHARS`.
    """
    value = request.headers.get("x-session-id")
    if value is not None and len(value) > MAX_SESSION_ID_CHARS:
        raise bad_request(f"X-Session-ID is {len(value)} characters; at most {MAX_SESSION_ID_CHARS}",
                          param="X-Session-ID")
    return value or None


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def guarded(handler: Handler, config: ServerConfig, public: bool = False) -> Handler:
    """``handler`` behind the key check, with an :class:`ApiError` (or any failure: a 500, logged
    without the request) answered as OpenAI's error body."""

    async def route(request: Request) -> Response:
        try:
            if not public:
                check_key(request, config)
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except Exception as e:  # a bug here must not end the server: answer 500, log it
            log.exception("request to %s failed", request.url.path)
            return error_response(ApiError(500, f"internal error: {type(e).__name__}", code="internal_error"))

    return route


async def until_disconnected(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (after the body was read, the next ASGI message
    is ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def reply(request: Request, work: Awaitable[dict[str, Any] | AsyncIterator[bytes]]) -> Response:
    """Run ``work`` (a route's reply) while watching for the client to go away (then its request
    is aborted, freeing its pages on the generator); a stream is started here, so a refusal before
    its first event (429, 503, 504) still has its status.

    Raises:
        ApiError: from ``work``.
    """
    result: dict[str, Any] | AsyncIterator[bytes] | None = None
    first: bytes | None = None
    error: ApiError | None = None
    done = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(until_disconnected, request.receive, tg.cancel_scope)
        try:
            result = await work
            if not isinstance(result, dict):
                first = await anext(result, None)
            done = True
        except ApiError as e:
            error, done = e, True
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    if not done:  # the client went away: the request was aborted
        if result is not None and not isinstance(result, dict):
            with anyio.CancelScope(shield=True):
                await result.aclose()  # type: ignore[attr-defined]
        return Response(status_code=499)
    if isinstance(result, dict):
        return Response(msgspec.json.encode(result), media_type="application/json")
    assert result is not None
    return EventStream(first, result)


class EventStream(Response):
    """A ``text/event-stream`` reply whose events come from an async iterator; the iterator is
    closed (its request aborted) when the client disconnects or a send fails."""

    media_type = "text/event-stream"

    def __init__(self, first: bytes | None, events: AsyncIterator[bytes]) -> None:
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # no content-length: chunked
        self.first, self.events = first, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.events) as events:  # type: ignore[type-var]
            async with anyio.create_task_group() as tg:
                tg.start_soon(until_disconnected, receive, tg.cancel_scope)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    if self.first is not None:
                        await send({"type": "http.response.body", "body": self.first, "more_body": True})
                    async for event in events:
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except ApiError as e:  # past the first event: the status is sent, tell it in the stream
                    await send({"type": "http.response.body", "more_body": False,
                                "body": b"data: " + msgspec.json.encode(e.body()) + b"\n\n"})
                except OSError:
                    pass  # the client is gone
                tg.cancel_scope.cancel()
