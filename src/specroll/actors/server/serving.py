"""Serving the app: its state built from a run's config and hub, the listening socket (bound here, so
a taken port fails before anything starts and port 0 is known at once), and uvicorn run inside the
caller's event loop without touching its signal handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import anyio
import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specroll.actors.config import RunConfig
from specroll.actors.config.server_section import ServerConfig
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.server.app import build_app
from specroll.actors.server.request_fields import Limits
from specroll.actors.server.requests import Router
from specroll.actors.server.state import ServerState, UpdateWeights
from specroll.actors.server.tool_calls import choose_tool_parser
from specroll.actors.server.tool_prompt import template_uses_tools
from specroll.engine.loaders.tokenizer import Tokenizer
from specroll.engine.model_config import ModelConfig

log = logging.getLogger("specroll.server")

URL_FILENAME = "server.url"
"""Once listening, the server writes its base URL (``http://HOST:PORT/v1``) to ``RUN_DIR/server.url``."""


def make_state(config: RunConfig, client: RolloutClient, tokenizer: Tokenizer, model: ModelConfig,
               update_weights: UpdateWeights | None) -> ServerState:
    """The server's state for a run: limits from the model and the engine, the tool parser for the
    model's chat template, and the hub's vocabulary check set.

    Raises:
        ValueError: ``server.tool_parser`` names no parser.
    """
    server = config.server
    engine_len = config.generator.engine.max_model_len
    max_model_len = min(model.max_position_embeddings, engine_len or model.max_position_embeddings)
    max_n = server.max_n or config.generator.engine.max_num_seqs
    limits = Limits(max_model_len, model.vocab_size, max_n, server.max_stop)
    template = tokenizer.chat_template
    client.vocab_size = model.vocab_size
    return ServerState(server, Router(client, tokenizer, server), tokenizer, limits,
                       server.model_name or config.model.name, choose_tool_parser(server.tool_parser, template),
                       template is not None and template_uses_tools(template), update_weights)


def bind(config: ServerConfig) -> socket.socket:
    """A listening TCP socket on ``server.host:server.port``.

    Raises:
        OSError: the address cannot be bound (taken, or not this host's).
    """
    host = config.host.removeprefix("[").removesuffix("]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: accepted connections inherit it, and asyncio sets TCP_NODELAY only on
    # sockets whose proto says TCP; without it Nagle holds a reply's body behind its headers until the
    # client's delayed ACK (~40 ms a non-streamed reply, bench_server.py).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, config.port))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://HOST:PORT/v1`` of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


class _HeadersDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on request headers: a connection whose next
    request's headers are not complete ``headers_timeout_s`` seconds after it opened (or after its
    last response) is closed. uvicorn has no such timeout, so clients that send headers a byte at a
    time would hold its connection slots (``limit_concurrency``) for as long as they like; the body
    has its own deadline in :func:`~specroll.actors.server.http.read_body`."""

    headers_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_deadline: asyncio.TimerHandle | None = None
        self._arm_headers_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_headers_deadline()

    def _arm_headers_deadline(self) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
        self._headers_deadline = self.loop.call_later(self.headers_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no reply: nothing of a request has been read that could be answered

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
        super().connection_lost(exc)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process's own handlers stay: the actor decides how it stops


async def serve_http(state: ServerState, sock: socket.socket, url_file: Path | None = None) -> None:
    """Serve ``state`` on ``sock`` until cancelled (then open connections get a short grace).

    ``url_file``: written with :func:`url_of` once listening.
    """
    server = state.config
    # server.body_timeout_s bounds the headers too (then the body, in read_body).
    protocol = type("HeadersDeadline", (_HeadersDeadline,), {"headers_timeout_s": server.body_timeout_s})
    uv = uvicorn.Config(build_app(state), http=protocol, log_level="warning", access_log=False, lifespan="off",
                        limit_concurrency=server.max_requests_in_flight + 64, timeout_keep_alive=30,
                        timeout_graceful_shutdown=2, h11_max_incomplete_event_size=64 * 1024)
    instance = _Server(uv)
    if url_file is not None:
        from specroll.actors.shared.files import write_text_atomic

        write_text_atomic(url_file, url_of(sock))
    log.info("OpenAI-compatible server on %s (model %r)", url_of(sock), state.model_name)
    try:
        await instance.serve(sockets=[sock])
    finally:
        instance.should_exit = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(3):
            if instance.started:
                await instance.shutdown(sockets=[sock])
        sock.close()
