"""The socket a peer actor (a generator, a drafter trainer) reaches the trainer through: one DEALER
channel, its frame cap and its connection monitor (``trainer_liveness.py`` reads it); the peer's
lifecycle over it is ``lifecycle.py``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from specroll.actors.peer.trainer_liveness import MONITOR_EVENTS
from specroll.protocol.channel import Channel
from specroll.protocol.codec import MAX_HEADER_BYTES
from specroll.protocol.curve import ClientKeys
from specroll.protocol.limits import DEFAULT_MAX_FRAME_BYTES, frame_limit
from specroll.protocol.sockets import close_socket, make_socket


@contextlib.asynccontextmanager
async def trainer_channel(endpoint: str, actor_id: str, inbound: Any, window: int,
                          linger_s: float, curve: ClientKeys | None = None, *,
                          max_header_bytes: int = MAX_HEADER_BYTES,
                          max_tensor_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> AsyncIterator[Channel[Any]]:
    """A DEALER channel connected to the trainer at ``endpoint`` (ZeroMQ identity ``actor_id``; a
    CURVE client with ``curve``); closed on exit with ``linger_s`` for the final ``Dead`` still queued.

    ``max_header_bytes`` bounds a message's header before it is decoded (the codec), and the socket
    takes no frame longer than that or ``max_tensor_bytes`` (``MAXMSGSIZE``): the largest message
    and tensor this peer accepts, so the trainer cannot make it buffer or decode more."""
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=actor_id.encode(), curve=curve,
                       monitor_events=MONITOR_EVENTS, max_frame_bytes=frame_limit(max_header_bytes, max_tensor_bytes))
    monitor = sock.get_monitor_socket()  # the one attached before the connect (TrainerLiveness reads it)
    try:
        yield Channel(sock, inbound, window=window, max_header_bytes=max_header_bytes)
    finally:
        monitor.close(linger=0)
        close_socket(sock, linger_ms=int(linger_s * 1000))
        ctx.term()
