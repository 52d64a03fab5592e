"""Whether a peer actor's trainer is still there (generators and the drafter trainer): the ZMTP
connection (the socket monitor's events) and the last message, with the trainer's own ``Dead``
told apart from its loss."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message


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
    """

    def __init__(self, endpoint: str, timeout_s: float, log: logging.Logger,
                 on_connected: Callable[[], None] | None = None, reconnect_s: float | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.reconnect_s = max(timeout_s, reconnect_s or timeout_s)
        self.log = log
        self.on_connected = on_connected
        # Assumed up until the socket monitor says otherwise: the monitor attaches after make_socket
        # connected, so it may miss the first handshake; a trainer never reached is caught by the
        # handshake's own timeout.
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
        """Track the ZMTP connection through the socket monitor (runs until cancelled)."""
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                self.connected = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
                self.last_alive = time.monotonic()
                self.log.info("%s the trainer at %s", "connected to" if self.connected else "lost the connection to",
                         self.endpoint)
                if self.connected and self.on_connected is not None:
                    self.on_connected()
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)

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
                            f"{self.reconnect_s} s")
