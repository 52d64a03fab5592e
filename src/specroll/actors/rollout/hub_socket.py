"""The hub's endpoint: one ZeroMQ context with, for CURVE, its ZAP authenticator; the ROUTER every
generator and drafter trainer connects to, its socket monitor and the channel over it; and the
last word to the peers (``Dead``) when the hub closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from specroll.protocol.channel import Channel
from specroll.protocol.codec import ProtocolError
from specroll.protocol.curve import RefusalLog, RunAuthenticator, ServerKeys
from specroll.protocol.messages import Dead, Hello, ToTrainer
from specroll.protocol.sockets import close_socket, last_endpoint, make_socket

log = logging.getLogger("specroll.client")

MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""What the hub's socket monitor reports: closed connections, failed security handshakes."""
DEAD_READ_S = 2.0
"""On close, seconds at most to wait until every peer read ``Dead`` (it answers ``Hello``)."""
DEAD_LINGER_MS = 1000
"""On close, milliseconds ZeroMQ may take to deliver what is still queued to peers still connected."""


class HubSocket:
    """The hub's ROUTER endpoint (module docstring).

    Args:
        bind: the endpoint to bind.
        window: the channel's flow-control window (data messages), equal on both ends.
        hwm: ZeroMQ high-water mark of the socket.
        allow_public: permit binding to a non-loopback address.
        curve: the run's server keys (the socket is a CURVE server admitting only the run's keys); None:
            no security.
        refusals: where the security layer's refusals are logged once each.
        max_frame_bytes: the longest frame a peer may send (``MAXMSGSIZE``).
    """

    def __init__(self, bind: str, *, window: int, hwm: int, allow_public: bool, curve: ServerKeys | None,
                 refusals: RefusalLog, max_frame_bytes: int) -> None:
        self.bind, self.window, self.hwm, self.allow_public = bind, window, hwm, allow_public
        self.curve, self.refusals, self.max_frame_bytes = curve, refusals, max_frame_bytes
        self.ctx: zmq.asyncio.Context | None = None
        self.socket: zmq.asyncio.Socket | None = None
        self.channel: Channel[Any] | None = None
        self.endpoint = ""
        """The bound endpoint with its real port (set by :meth:`open`)."""
        self._monitor: zmq.asyncio.Socket | None = None
        self._auth: RunAuthenticator | None = None

    def open(self) -> Channel[Any]:
        """Bind (the authenticator and the monitor first, so no handshake goes unseen) and return the
        channel over the socket.

        Raises:
            ValueError: a public bind without ``allow_public``, or a malformed endpoint.
            zmq.ZMQError: the bind failed (e.g. the port is taken).
        """
        self.ctx = zmq.asyncio.Context()
        try:
            if self.curve is not None:  # the ZAP handler runs before anything can connect
                self._auth = RunAuthenticator(self.ctx, self.curve, self.refusals)
                self._auth.start()
            self.socket = make_socket(self.ctx, zmq.ROUTER, bind=self.bind, hwm=self.hwm,
                                      allow_public=self.allow_public, curve=self.curve,
                                      monitor_events=MONITOR_EVENTS, max_frame_bytes=self.max_frame_bytes)
        except BaseException:
            self._stop_auth()
            self.ctx.term()
            raise
        self._monitor = self.socket.get_monitor_socket()  # attached before the bind
        self.endpoint = last_endpoint(self.socket)
        self.channel = Channel(self.socket, ToTrainer, window=self.window)
        return self.channel

    async def watch(self, disconnected: Callable[[int, float], None]) -> None:
        """Call ``disconnected(fd, now)`` for each connection that closed (the socket monitor's
        ``EVENT_DISCONNECTED``), and log each kind of failed security handshake once (the
        authenticator logs refused keys). Runs until cancelled."""
        assert self.socket is not None and self._monitor is not None
        monitor = self._monitor
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    disconnected(int(event["value"]), time.monotonic())
                else:
                    self.refusals.handshake_failed(event["event"], int(event["value"]), self.curve is not None)
        finally:
            self.socket.disable_monitor()
            monitor.close(linger=0)
            self._monitor = None

    async def say_dead(self, peers: list[str], actor_id: str) -> None:
        """Send each peer ``Dead``, the last message it gets from this hub (a generator started alone
        then exits 0), and keep the connection open until it read it: a peer's socket drops what it
        received but had not read when the connection closes (``IMMEDIATE``), so closing at once loses
        the notice. A peer that read ``Dead`` answers ``Hello`` (it registers again with whichever
        trainer comes next); one that does not answer within ``DEAD_READ_S`` (gone, or not reading)
        is left. ``Dead`` is a control message: it needs no credit and is handed to the socket at once."""
        assert self.channel is not None
        dead = Dead(actor_id=actor_id, reason="client closed")
        unread = set()
        for actor in peers:
            if await self.channel.send_control_now(dead, peer=actor.encode()):
                unread.add(actor.encode())
            else:
                log.info("%s is gone or does not read: no Dead for it", actor)
        log.info("Dead sent to %d peers; waiting until they read it", len(unread))
        with anyio.move_on_after(DEAD_READ_S):
            while unread:
                try:
                    received = await self.channel.recv()
                except ProtocolError:
                    continue
                if isinstance(received.msg, Hello):
                    unread.discard(received.peer or b"")
        if unread:
            log.info("no answer to Dead from %s within %.0f s", sorted(p.decode(errors="replace") for p in unread),
                     DEAD_READ_S)

    def close(self) -> None:
        """Close the monitor and the socket (``DEAD_LINGER_MS`` for what is still queued), sum up the
        refusals, stop the authenticator and terminate the context."""
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self.socket is not None:
            close_socket(self.socket, linger_ms=DEAD_LINGER_MS)
        if (summary := self.refusals.summary()) is not None:
            log.info("%s", summary)
        self._stop_auth()
        if self.ctx is not None:
            self.ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
