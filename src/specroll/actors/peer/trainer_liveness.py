"""Whether a peer actor's trainer is still there (generators and the drafter trainer): the ZMTP
connection (the socket monitor's events) and the last message, with the trainer's own ``Dead``
told apart from its loss."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from specroll.protocol.curve import MECHANISM_MISMATCH

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
CONNECTION_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, errno.ECONNREFUSED,
                               errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN})
"""Values of ``EVENT_HANDSHAKE_FAILED_NO_DETAIL`` that say the connection ended during the handshake
(e.g. 0x68, ECONNRESET: the trainer was killed), not that the two sides' security disagrees."""
MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
"""The socket monitor's events a peer watches (``make_socket(monitor_events=...)``)."""


class TrainerLiveness:
    """The trainer counts as alive while connected (ZMTP heartbeats drop a dead peer's connection)
    or while it sent a message within ``timeout_s``; ZeroMQ keeps reconnecting meanwhile.

    Args:
        endpoint: the trainer's endpoint (for log lines).
        timeout_s: seconds without connection and message after which a trainer that said ``Dead``
            (a finished run) is gone for good.
        log: the actor's logger.
        reconnect_s: seconds without connection and message after which a trainer that vanished
            without ``Dead`` (it crashed; ``specroll launch`` restarts it from its checkpoint) is
            lost; at least ``timeout_s`` (None: ``timeout_s``).
        on_connected: called whenever a connection to the endpoint comes up (after the trainer's
            ``Dead``, that is a new trainer).
        on_refused: called with the reason when the trainer refuses the connection's security for
            good (CURVE: our key is not one of the run's; or one side runs CURVE and the other
            not): ZeroMQ stops reconnecting then, so waiting would only time out.
    """

    def __init__(self, endpoint: str, timeout_s: float, log: logging.Logger,
                 on_connected: Callable[[], None] | None = None, reconnect_s: float | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.reconnect_s = max(timeout_s, reconnect_s or timeout_s)
        self.log = log
        self.on_connected = on_connected
        self.on_refused = on_refused
        self._handshake_failed = False
        self._handshaken = False
        """The current connection completed its handshake (a later close is reconnected here)."""
        # Assumed up until the socket monitor says otherwise (a trainer never reached is caught by
        # the handshake's own timeout).
        self.connected = True
        self.last_alive = time.monotonic()
        self.said_dead = False
        """The trainer announced its exit (``Dead``) and has not said anything since."""

    def heard(self, dead: bool = False) -> None:
        """A message arrived from the trainer (``dead``: its ``Dead``)."""
        self.last_alive = time.monotonic()
        self.said_dead = dead
        if dead:
            self.connected = False

    async def watch_connection(self, socket: zmq.asyncio.Socket) -> None:
        """Track the ZMTP connection through the socket monitor (runs until cancelled). The socket
        should have been made with ``monitor_events=MONITOR_EVENTS``, so that the monitor saw the
        first handshake; otherwise one is attached now."""
        monitor = socket.get_monitor_socket(MONITOR_EVENTS)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] & HANDSHAKE_FAILED:
                    self._on_handshake_failed(event["event"], int(event["value"]))
                    continue
                was_connected = self.connected
                self.connected = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
                self.last_alive = time.monotonic()
                if event["event"] == zmq.EVENT_DISCONNECTED and self._handshaken:
                    # libzmq reconnects after a lost connection, but not after a protocol error — a
                    # frame over the socket's MAXMSGSIZE from the trainer: connect afresh either way,
                    # so no message can end the connection for good (a refused handshake stays final)
                    socket.disconnect(self.endpoint)
                    socket.connect(self.endpoint)
                self._handshaken = self.connected
                if self.connected or was_connected:  # not once per failed reconnect
                    self.log.info("%s the trainer at %s",
                                  "connected to" if self.connected else "lost the connection to", self.endpoint)
                if self.connected and self.on_connected is not None:
                    self.on_connected()
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)

    def _on_handshake_failed(self, kind: int, value: int) -> None:
        """A failed ZMTP handshake: the trainer refused our CURVE key (ZAP status ``value``), or the
        two sides disagree on the mechanism — final, :attr:`on_refused` — or it failed without
        detail (a wrong server key: the trainer cannot read us; logged once, the handshake's own
        timeout ends the wait)."""
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"the trainer at {self.endpoint} refused our CURVE key (ZAP status {value}): it is not one of the "
                   "run's keys for this role; use the run's keys (--keys, network.keys_dir)")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == MECHANISM_MISMATCH:
            why = (f"the trainer at {self.endpoint} and this peer disagree on network.security (one runs CURVE, the "
                   "other not); set the same network.security on both")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in CONNECTION_ERRNOS:
            # the connection itself ended mid-handshake (a trainer killed or restarting): not security
            self.log.info("the connection to the trainer at %s ended during its handshake (%s); retrying",
                          self.endpoint, errno.errorcode.get(value, value))
            return
        else:
            if not self._handshake_failed:
                self._handshake_failed = True
                self.log.warning("the security handshake with the trainer at %s failed (%s %#x): %s; retrying",
                                 self.endpoint, zmq.Event(kind).name, value, self.handshake_hint())
            return
        self.log.error("%s", why)
        if self.on_refused is not None:
            self.on_refused(why)

    def handshake_hint(self) -> str:
        """What a security handshake that failed without detail most likely means."""
        return ("the trainer runs another network.security than this peer, or this peer has another run's "
                "server key (check --keys / network.keys_dir and network.security on both sides)")

    def why_unreached(self) -> str:
        """The clause a peer that never reached the trainer adds to its last line ('' when no
        security handshake failed)."""
        return f"; the security handshake failed: {self.handshake_hint()}" if self._handshake_failed else ""

    async def watchdog(self, lost: Callable[[bool, str], None]) -> None:
        """Call ``lost(ended, reason)`` once the trainer is gone: ``timeout_s`` after its ``Dead``
        (``ended``: a finished run), ``reconnect_s`` after it vanished without one; checks every
        second at most."""
        while True:
            await anyio.sleep(min(1.0, self.timeout_s / 4))
            now = time.monotonic()
            if self.connected:
                self.last_alive = now
            elif self.said_dead and now - self.last_alive > self.timeout_s:
                lost(True, f"the trainer ended and did not come back within {self.timeout_s} s")
            elif not self.said_dead and now - self.last_alive > self.reconnect_s:
                lost(False, f"no connection to and no message from the trainer at {self.endpoint} for "
                            f"{self.reconnect_s} s{self.why_unreached()}")
