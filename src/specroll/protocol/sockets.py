"""Every ZeroMQ socket of specroll is made here, with vetted options; none is configured ad hoc.

Data travels ROUTER ↔ DEALER (or PUSH → PULL), never PUB/SUB, which drops messages at its HWM.
"""

from __future__ import annotations

import ipaddress
from typing import TypeVar

import zmq

from specroll.protocol.curve import ClientKeys, ServerKeys, apply
from specroll.protocol.limits import DEFAULT_MAX_FRAME_BYTES

S = TypeVar("S", bound=zmq.Socket)  # type: ignore[type-arg]

DEFAULT_HWM = 1000
"""Messages queued per peer and direction before a send waits (credit windows stay well below)."""
DEFAULT_HEARTBEAT_IVL_MS = 1000
"""ZMTP PING interval of a connecting socket (a peer); a ROUTER sends none (:func:`make_socket`)."""
DEFAULT_HEARTBEAT_TIMEOUT_MS = 10_000
IPC_PATH_MAX = 107
"""Linux limit on a Unix socket path (``sockaddr_un.sun_path`` less the terminator)."""
KINDS = {zmq.ROUTER: "ROUTER", zmq.DEALER: "DEALER", zmq.PUSH: "PUSH", zmq.PULL: "PULL"}


def _is_local(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host; ValueError for anything unparsable."""
    transport, sep, rest = endpoint.partition("://")
    if not sep or not rest:
        raise ValueError(f"endpoint {endpoint!r}: expected TRANSPORT://ADDRESS")
    if transport in ("ipc", "inproc"):
        if transport == "ipc" and len(rest.encode()) > IPC_PATH_MAX:
            raise ValueError(f"endpoint {endpoint!r}: ipc path has {len(rest.encode())} bytes, max {IPC_PATH_MAX}")
        return True
    if transport != "tcp":
        raise ValueError(f"endpoint {endpoint!r}: transport {transport!r}, expected tcp, ipc or inproc")
    host, sep, port = rest.rpartition(":")
    if not sep or not (port == "*" or port.isdigit()):
        raise ValueError(f"endpoint {endpoint!r}: expected tcp://HOST:PORT (PORT a number, 0 or * for a free one)")
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name, hostname or "*": public


def make_socket(
    ctx: zmq.Context[S],
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = DEFAULT_HWM,
    identity: bytes | None = None,
    linger_ms: int = 0,
    allow_public: bool = False,
    heartbeat_ivl_ms: int | None = None,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
    curve: ServerKeys | ClientKeys | None = None,
    monitor_events: int = 0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> S:
    """Create a socket of ``ctx`` (sync or ``zmq.asyncio``), set its options, bind or connect it.

    Options: ``ROUTER_MANDATORY`` on ROUTERs (a message to an unknown peer raises
    ``EHOSTUNREACH`` instead of vanishing, and a full peer makes the send wait) and
    ``ROUTER_HANDOVER`` (a restarted peer that connects under its old id takes the route over even
    while its dead connection has not been dropped yet; ids are names, not credentials); ``SNDHWM`` and
    ``RCVHWM`` = ``hwm`` messages; ``LINGER`` = ``linger_ms`` (0: close drops unsent messages; use a
    short linger, or :func:`close_socket`, only for the final ``Dead`` notice); TCP keepalive and
    ZMTP heartbeats, so a dead peer's connection is dropped; ``IMMEDIATE`` on connecting DEALER/PUSH
    sockets, so a send waits for a live connection instead of queueing for a peer not there yet.

    A ROUTER sends no ZMTP PINGs of its own (``HEARTBEAT_IVL`` 0 unless ``heartbeat_ivl_ms`` says
    otherwise): libzmq 4.3.5 (the newest release; its master as of 2026-07 too) aborts the whole
    process with ``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`` when the PING
    timer fires on a connection whose input had stopped and which then saw a reset or hang-up. A
    ROUTER's input stops on a connection whose route a peer's new connection took over
    (``ROUTER_HANDOVER``) while the old one still delivers — what a stalled link or a paused
    trainer leaves — so the trainer aborted on network faults its peers recover from
    (``benchmarks/zmq_abort.py`` reproduces it; docs/running-rl.md, "Network faults"). Without its
    own PINGs the ROUTER still answers its peers' PINGs and drops a connection that stays silent past
    the TTL they announce (their ``HEARTBEAT_TTL``), and the actors' own heartbeats say which peers
    are alive.

    Args:
        kind: ``zmq.ROUTER``, ``zmq.DEALER``, ``zmq.PUSH`` or ``zmq.PULL``.
        bind / connect: exactly one endpoint. A bind to ``tcp://127.0.0.1:0`` (or ``:*``) takes a
            free port; read it back with :func:`last_endpoint`.
        identity: ZeroMQ routing id (what the peer ROUTER sees), e.g. the actor id.
        allow_public: permit binding to a non-loopback address.
        curve: CURVE security (``protocol/curve.py``): a server's keys (bind; the context must run
            the ZAP authenticator, or every handshake fails) or a client's (connect).
        heartbeat_ivl_ms: milliseconds between ZMTP PINGs; None: ``DEFAULT_HEARTBEAT_IVL_MS``, or 0
            (none) on a ROUTER (above).
        heartbeat_timeout_ms: a connection whose PING went unanswered this long is dropped; also
            the TTL announced in this socket's PINGs.
        monitor_events: a ``zmq.EVENT_*`` mask: the socket monitor is attached before the bind or
            connect, so no event is missed (a refused first handshake included); read it with
            ``sock.get_monitor_socket()``, which returns that same monitor, and close it before the
            context is terminated. 0: none.
        max_frame_bytes: ``MAXMSGSIZE``: a peer whose frame is longer is disconnected before the
            frame's body is read, so no memory is spent on it (size it with
            :func:`~specroll.protocol.limits.frame_limit` from what the receiver accepts).

    Raises:
        ValueError: an unsupported kind, not exactly one endpoint, a malformed endpoint, or a public
            bind without ``allow_public`` (the message names the address).
        zmq.ZMQError: the bind or connect itself failed (e.g. the port is taken).
    """
    if max_frame_bytes < 1:
        raise ValueError(f"max_frame_bytes={max_frame_bytes}, expected a positive number of bytes")
    if kind not in KINDS:
        raise ValueError(f"socket kind {kind}: expected one of {sorted(KINDS.values())} (no PUB/SUB for data)")
    if (bind is None) == (connect is None):
        raise ValueError(f"give exactly one of bind= and connect= (got bind={bind!r}, connect={connect!r})")
    if bind is not None and not _is_local(bind) and not allow_public:
        raise ValueError(f"refusing to bind {bind!r}: not a loopback or ipc address; allow_public=True exposes it")
    if connect is not None:
        _is_local(connect)  # validates the syntax; connecting to a remote host is normal
    if curve is not None and isinstance(curve, ServerKeys) != (bind is not None):
        raise ValueError("a CURVE server's keys go with bind=, a client's with connect=")
    sock = ctx.socket(kind)
    monitor = None
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)  # seconds
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        if heartbeat_ivl_ms is None:
            heartbeat_ivl_ms = 0 if kind == zmq.ROUTER else DEFAULT_HEARTBEAT_IVL_MS
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, heartbeat_timeout_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if curve is not None:
            apply(sock, curve)
        if monitor_events:
            monitor = sock.get_monitor_socket(monitor_events)
        if "://[" in (bind or connect or ""):
            sock.setsockopt(zmq.IPV6, 1)  # an IPv6 literal; off otherwise so "localhost" stays IPv4
        if bind is not None:
            sock.bind(bind)
        else:
            if kind in (zmq.DEALER, zmq.PUSH):
                sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(connect)  # type: ignore[arg-type]
    except BaseException:
        if monitor is not None:
            monitor.close(linger=0)
        sock.close(linger=0)
        raise
    return sock


def last_endpoint(sock: zmq.Socket) -> str:  # type: ignore[type-arg]
    """The endpoint the socket last bound or connected, with the real port (after ``:0`` or ``:*``)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def close_socket(sock: zmq.Socket, linger_ms: int = 0) -> None:  # type: ignore[type-arg]
    """Close ``sock``; ``linger_ms`` > 0 gives queued messages (the final ``Dead``) that long to leave."""
    sock.close(linger=linger_ms)
