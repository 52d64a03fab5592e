"""A role's ``GET /metrics``: Prometheus's text format from a registry of its own, served by a small
HTTP server in a daemon thread, and the target file that tells Prometheus where it is.

* Bounded: at most ``MAX_CONNECTIONS`` connections at once (one more is closed), each cut
  ``CONNECTION_S`` seconds after it was accepted whatever its client does; the reply is the
  registry's few hundred lines. A scraper that hangs or drips holds one connection for a while,
  never the other scrapes nor the role's exit.
* ``GET`` or ``HEAD /metrics`` only (404 on any other path, 405 for any other method).
* ``[metrics] api_key``: every request must carry ``Authorization: Bearer KEY`` (compared in constant
  time; 401 otherwise). A non-loopback ``host`` needs it (or ``network.allow_insecure``), the same
  rule as the OpenAI-compatible server's.
* ``RUN_DIR/metrics/targets/<actor>.json``: ``[{"targets": ["HOST:PORT"], "labels": {"run": ...,
  "role": ..., "actor": ...}}]``, Prometheus's ``file_sd_configs`` format (``run``: the run
  directory's name, so one Prometheus can scrape several runs), written atomically once the port is
  bound (``port = 0`` picks a free one) and removed when the role exits. A restarted role writes it
  again.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from socketserver import BaseServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from specroll.actors.config import RunConfig
from specroll.actors.shared.files import write_text_atomic
from specroll.actors.telemetry.families import CallbackCollector

log = logging.getLogger("specroll.metrics")

TARGETS_DIR = Path("metrics") / "targets"
"""Under the run directory: one ``file_sd`` target file per live role."""
CONNECTION_S = 10.0
"""Seconds a connection may last, from its accept to its reply: then it is cut, whatever it was doing."""
MAX_CONNECTIONS = 8
"""Connections served at once; one more is closed at once."""


class _Handler(WSGIRequestHandler):
    """One connection, cut after :data:`CONNECTION_S` seconds however slowly its client sends."""

    timeout = CONNECTION_S

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(CONNECTION_S, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # unblocks the handler's read; it then ends

    def finish(self) -> None:
        self._deadline.cancel()
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` at once: a client that sends slowly (or
    never) holds one for :data:`CONNECTION_S` at most, and neither other scrapes nor :meth:`shutdown`
    wait for it."""

    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: this one is dropped
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: a connection from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _app(registry: CollectorRegistry, api_key: str) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: ``GET /metrics`` in Prometheus's text format 0.0.4, whatever the client's
    ``Accept`` asks; 401 without ``Authorization: Bearer api_key`` (when one is set); 404 elsewhere.

    Always the text format: prometheus_client's OpenMetrics output (what Prometheus 2 asks for first)
    rewrites the ``:`` of every sample name to ``_`` (``vllm:num_requests_running`` would be stored as
    ``vllm_num_requests_running``; prometheus/client_python issue 1177), and vLLM's names need it."""
    expected = api_key.encode()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only GET /metrics here\n"]
        method = environ.get("REQUEST_METHOD", "")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")])
            return [b"only GET /metrics here\n"]
        scheme, _, key = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if api_key and not (scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), expected)):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"metrics.api_key required: Authorization: Bearer KEY\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [] if method == "HEAD" else [body]

    return app


class MetricsBindError(OSError):
    """A role's metrics port cannot be bound (in use, or not allowed): a configuration problem."""


class MetricsEndpoint:
    """A role's ``/metrics`` (module docstring); :meth:`close` stops it and removes its target file.

    Args:
        config: the run config (``[metrics]``, ``run_dir``).
        role: ``trainer``, ``generator``, ``drafter`` or ``server`` (the target's ``role`` label).
        actor_id: the process's id (its port offset, its target file's name and ``actor`` label).
        collect: builds the role's families at each scrape (``families.family``).

    Raises:
        MetricsBindError: the port cannot be bound (in use, or not allowed), naming the address.
    """

    def __init__(self, config: RunConfig, role: str, actor_id: str, collect: Callable[[], Iterable[Metric]]) -> None:
        m = config.metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CallbackCollector(collect))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        host = m.host.removeprefix("[").removesuffix("]")
        port = m.port_for(actor_id)
        server_class = _Server6 if ":" in host else _Server
        try:
            self._server: BaseServer = make_server(host, port, _app(self.registry, m.api_key),
                                                   server_class=server_class, handler_class=_Handler)
        except OSError as e:
            raise MetricsBindError(e.errno, f"metrics endpoint of {actor_id}: cannot bind {m.host}:{port} "
                                            f"({e.strerror}); set metrics.port to a free base port, or 0 for free "
                                            "ports") from None
        self.port: int = self._server.server_address[1]  # type: ignore[attr-defined]
        shown = socket.gethostname() if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
        self.url = f"http://{shown}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"metrics-{actor_id}", daemon=True)
        self._thread.start()
        self.target = Path(config.run_dir) / TARGETS_DIR / f"{re.sub(r'[^A-Za-z0-9._-]', '_', actor_id)}.json"
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.target, mode=0o644, text=json.dumps(
                [{"targets": [f"{shown}:{self.port}"], "labels": {"run": run_label(config), "role": role,
                                                                  "actor": actor_id}}]) + "\n")
        except OSError as e:
            log.warning("metrics: cannot write the target file %s: %s", self.target, e)
        log.info("metrics: %s serves %s", actor_id, self.url)

    def close(self) -> None:
        """Stop serving and remove the target file (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
        self.target.unlink(missing_ok=True)


def run_label(config: RunConfig) -> str:
    """The ``run`` label of a run's targets: its run directory's name (``runs/gsm8k`` → ``gsm8k``)."""
    return Path(config.run_dir).resolve().name or str(config.run_dir)


def open_endpoint(config: RunConfig, role: str, actor_id: str,
                  collect: Callable[[], Iterable[Metric]]) -> MetricsEndpoint | None:
    """:class:`MetricsEndpoint` when ``metrics.enabled``, else None.

    Raises:
        MetricsBindError: the port cannot be bound.
    """
    return MetricsEndpoint(config, role, actor_id, collect) if config.metrics.enabled else None


@contextlib.contextmanager
def serving_metrics(config: RunConfig, role: str, actor_id: str,
                    collect: Callable[[], Iterable[Metric]]) -> Iterator[MetricsEndpoint | None]:
    """:func:`open_endpoint` for the block, closed (its target file removed) however the block ends.

    Raises:
        MetricsBindError: the port cannot be bound (before the block runs).
    """
    endpoint = open_endpoint(config, role, actor_id, collect)
    try:
        yield endpoint
    finally:
        if endpoint is not None:
            endpoint.close()
