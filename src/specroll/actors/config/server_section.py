"""``[server]``: the OpenAI-compatible HTTP server in front of a run's generators (``actors/server/``)."""

from __future__ import annotations

from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import is_loopback_host
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_count as _require_count
from specroll.actors.config.section import require_seconds as _require_seconds

MAX_BODY_BYTES_CAP = 256 << 20
"""The largest ``max_body_bytes`` accepted (256 MiB): a body is read into memory before it is parsed."""


class ServerConfig(_Section):
    """The OpenAI-compatible server (``[server]``): ``specroll launch`` runs it in the trainer's process
    when ``enabled``; ``specroll serve`` runs it in a process of its own, in front of the generators."""

    enabled: bool = False
    """Serve HTTP in the trainer's process under ``specroll launch`` (``specroll serve`` always serves).
    Default false."""
    host: str = "127.0.0.1"
    """Address the server binds. Default ``127.0.0.1``; a non-loopback address needs ``api_key`` (or
    ``network.allow_insecure``)."""
    port: int = 8000
    """TCP port; 0 picks a free one (written to ``RUN_DIR/server.url``). Default 8000."""
    api_key: str = ""
    """Bearer key every request but ``GET /health`` must carry (``Authorization: Bearer KEY``, compared
    in constant time); empty (default): no key. Never logged."""
    model_name: str = ""
    """The model id clients name in ``model`` (and ``GET /v1/models`` lists); empty (default): ``model.name``."""
    max_requests_in_flight: int = 256
    """Requests accepted and unfinished at once, 1 to 65536; one more is answered 429 with ``Retry-After``.
    Default 256."""
    max_n: int = 0
    """Most choices per request (``n``); at most ``generator.engine.max_num_seqs`` (a request's choices
    run on one generator); 0 (default): ``generator.engine.max_num_seqs``."""
    max_body_bytes: int = 4 << 20
    """Largest request body in bytes (413 beyond). Default 4 MiB."""
    body_timeout_s: float = 30.0
    """Seconds a client may take to send a request's headers (from its connection, or its previous
    reply; then it is dropped), and again its body (then answered 408 and dropped), without holding
    up anyone else. At most 3600. Default 30."""
    request_timeout_s: float = 600.0
    """Seconds a request may take from its arrival to its last token, waiting (paused, no room on a
    generator) and generating together; then it is aborted and answered 504. At most 86400. Default 600."""
    max_stop: int = 16
    """Most ``stop`` strings per request (each at most 256 characters). Default 16."""
    tool_parser: Literal["auto", "hermes", "none"] = "auto"
    """How ``message.tool_calls`` are read from a chat reply: ``hermes`` (``<tool_call>{json}</tool_call>``,
    Hermes / Qwen), ``none`` (never), ``auto`` (default: ``hermes`` when the chat template mentions
    ``<tool_call>`` or ignores ``tools``, in which case the server describes the tools in a system
    message of that format)."""
    weights_dir: str = ""
    """The folder ``POST /update_weights`` may read from (a request's ``path`` must lie inside it, links
    resolved); empty (default): ``RUN_DIR/weights``. Under ``specroll launch`` the trainer owns the
    policy and the route answers 409."""
    weights_timeout_s: float = 300.0
    """Seconds ``POST /update_weights`` waits for every generator to serve the new version (504 after,
    the version still published). At most 86400. Default 300."""
    session_ttl_s: float = 600.0
    """Seconds an ``X-Session-ID`` stays pinned to its generator after its last request, at most a week.
    Default 600."""
    max_sessions: int = 65536
    """Sessions remembered at once (the least recently used is forgotten first), 1 to 1,048,576. Default 65536."""
    stitch_sessions: int = 4096
    """Sessions whose last chat turn is kept, so that their next turn's prompt is that turn's prompt
    and completion tokens plus the new messages' tokens (token-in-token-out: earlier turns are never
    rendered and tokenized again; docs/server.md, "Sessions"); 0 renders every turn from its messages.
    Default 4096."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(bool(self.host) and self.host == self.host.strip(), "host", self.host, "an address")
        _require(0 <= self.port <= 65535, "port", self.port, "a port in [0, 65535]")
        _require_count("max_requests_in_flight", self.max_requests_in_flight, 1, 1 << 16)
        _require(self.max_n >= 0, "max_n", self.max_n, "a positive integer, or 0 for generator.engine.max_num_seqs")
        _require(1024 <= self.max_body_bytes <= MAX_BODY_BYTES_CAP, "max_body_bytes", self.max_body_bytes,
                 f"an integer in [1024, {MAX_BODY_BYTES_CAP}]")
        _require_seconds("body_timeout_s", self.body_timeout_s, 3600)
        _require_seconds("request_timeout_s", self.request_timeout_s, 86400)
        _require(0 <= self.max_stop <= 256, "max_stop", self.max_stop, "an integer in [0, 256]")
        _require_seconds("weights_timeout_s", self.weights_timeout_s, 86400)
        _require_seconds("session_ttl_s", self.session_ttl_s)
        _require_count("max_sessions", self.max_sessions)
        _require(0 <= self.stitch_sessions <= self.max_sessions, "stitch_sessions", self.stitch_sessions,
                 "an integer in [0, server.max_sessions]")
        _require(self.api_key == self.api_key.strip(), "api_key", "<hidden>",
                 "a key without leading or trailing spaces")

    def is_loopback(self) -> bool:
        """Whether :attr:`host` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
        return is_loopback_host(self.host)
