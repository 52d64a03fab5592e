"""A TCP relay that puts network faults between a peer and the trainer, for the tests and
``bench_chaos.py --network``.

One listening loopback port; every connection accepted there is relayed to one target (the
trainer's endpoint). Give a generator the relay's :attr:`FaultProxy.endpoint` instead of the
trainer's, and from any thread:

* :meth:`~FaultProxy.delay` — each chunk is forwarded that many milliseconds after it was read;
* :meth:`~FaultProxy.throttle` — each direction of each connection at most that many bytes a second;
* :meth:`~FaultProxy.stall` — nothing is forwarded either way for that many seconds (or until
  :meth:`~FaultProxy.resume`); every socket stays open, so the peers see a silent link, not a close.
  Connections made meanwhile stall too (the whole link), or with ``new_connections=False`` are
  relayed at once (only the flows open at the stall hang, as behind a stuck middlebox); a stall
  may be limited to one peer's connections (below);
* :meth:`~FaultProxy.cut` ``"reset"`` — the connections are closed with RST on both sides
  (``SO_LINGER`` 0, then close), as a rebooted router or a killed host's kernel would;
* :meth:`~FaultProxy.cut` ``"half-open"`` — the connections stop forwarding for good and are never
  closed: neither side gets a FIN or RST and both sockets stay ESTABLISHED (this relay's kernel
  even answers TCP keepalive probes), as after a host lost behind a NAT; only ZMTP heartbeats or
  the actors' own liveness can tell. New connections are relayed as usual, unless
  :meth:`~FaultProxy.refuse_new` (a host gone for good: every new connection is reset at once).

A stall or a cut may be limited to the connections of one ZeroMQ peer: the relay reads the routing
id each connection announces in its ZMTP ``READY`` (plain ZMTP only; under CURVE it is encrypted,
and only faults of every connection apply).

The relay runs its own asyncio loop in a daemon thread, so a test's or a benchmark's own loop (or
none) can drive it; every control returns once it is in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")

CHUNK = 64 * 1024
"""Bytes read at most per chunk (a throttled link reads less: about 20 chunks a second)."""
_IDENTITY = b"\x08Identity"
"""A ZMTP ``READY`` property's name as it is framed (its length in one byte, then the name)."""


@dataclass(eq=False)
class _Link:
    """One relayed connection: the peer's side, the target's side and the two pumps between them."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    identity: bytes | None = None
    """The routing id the peer announced in its ZMTP ``READY`` (None until seen, or never)."""
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the link forwards (cleared by a stall)."""
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    sniffed: bytes = b""
    """The first bytes the peer sent, kept until its identity is read (at most 1 KiB)."""


class FaultProxy:
    """A TCP relay with faults (module docstring).

    Args:
        target: where connections are relayed, ``tcp://HOST:PORT`` (e.g. the trainer's endpoint).
        listen_port: the port to listen on, on 127.0.0.1; 0 (default) picks a free one.

    Raises:
        ValueError: ``target`` is not ``tcp://HOST:PORT``.
    """

    def __init__(self, target: str, listen_port: int = 0) -> None:
        host, sep, port = target.removeprefix("tcp://").rpartition(":")
        if not target.startswith("tcp://") or not sep or not host or not port.isdigit():
            raise ValueError(f"target {target!r}: expected tcp://HOST:PORT")
        self.target = (host.strip("[]"), int(port))
        self.listen_port = listen_port
        self.accepted = 0
        """Connections accepted so far."""
        self.forwarded = 0
        """Bytes forwarded so far, both ways."""
        self._delay_s = 0.0
        self._rate: float | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._held: list[_Link] = []
        """Half-open links: nothing forwarded, nothing closed, until the relay closes."""
        self._stall_new = False
        """Connections accepted now start stalled (a stall of the whole link is in force)."""
        self._refuse = False
        self._stall_ends: list[asyncio.TimerHandle] = []

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Start the loop's thread and listen. Returns self."""
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening, reset every connection still open (held half-open ones included), stop the loop."""
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        """``tcp://127.0.0.1:PORT``: what a peer connects to instead of the target."""
        return f"tcp://127.0.0.1:{self.listen_port}"

    @property
    def open_links(self) -> int:
        """Connections being relayed now (half-open ones not counted)."""
        return len(self._links)

    def identities(self) -> list[bytes]:
        """The routing ids announced on the connections relayed now."""
        return [link.identity for link in list(self._links) if link.identity is not None]

    # ---- faults -----------------------------------------------------------------------------------

    def delay(self, ms: float) -> None:
        """Forward every chunk ``ms`` milliseconds after it was read (0: at once).

        Raises:
            ValueError: a negative delay.
        """
        if ms < 0:
            raise ValueError(f"delay {ms} ms: expected a number of milliseconds >= 0")
        self._delay_s = ms / 1000

    def throttle(self, bytes_per_s: float | None) -> None:
        """At most ``bytes_per_s`` bytes a second in each direction of each connection (None: no limit).

        Raises:
            ValueError: a rate that is not positive.
        """
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"throttle {bytes_per_s} bytes/s: expected a positive rate, or None for none")
        self._rate = bytes_per_s

    def stall(self, seconds: float | None = None, new_connections: bool = True, identity: bytes | None = None) -> int:
        """Forward nothing either way for ``seconds`` (None: until :meth:`resume`); sockets stay open.
        ``new_connections``: connections accepted meanwhile stall too; False: they are relayed.
        ``identity``: stall only the connections of that ZeroMQ peer (new ones are relayed). Returns
        how many open connections were stalled.

        Raises:
            ValueError: a negative duration.
        """
        if seconds is not None and seconds < 0:
            raise ValueError(f"stall {seconds} s: expected a number of seconds >= 0, or None until resume()")
        return self._call(self._stall(seconds, new_connections and identity is None, identity))

    def resume(self) -> None:
        """End every stall now: each stalled connection forwards what it holds."""
        self._call(self._resume())

    def refuse_new(self, refuse: bool = True) -> None:
        """Reset every connection accepted from now on (``refuse``), or relay them again."""
        self._refuse = refuse

    def cut(self, how: Literal["reset", "half-open"], identity: bytes | None = None) -> int:
        """Cut every connection relayed now (only the ones whose peer announced ``identity``, if given):
        ``"reset"`` closes both sides with RST; ``"half-open"`` stops forwarding for good and never
        closes either side. Returns how many were cut.

        Raises:
            ValueError: ``how`` is neither.
        """
        if how not in ("reset", "half-open"):
            raise ValueError(f"cut {how!r}: expected 'reset' or 'half-open'")
        return self._call(self._cut(how, identity))

    # ---- the loop's side --------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for link in [*self._links, *self._held]:
            self._drop(link, reset=True)
        self._links.clear()
        self._held.clear()

    async def _stall(self, seconds: float | None, new_connections: bool, identity: bytes | None) -> int:
        chosen = [link for link in self._links if identity is None or link.identity == identity]
        for link in chosen:
            link.flowing.clear()
        self._stall_new = self._stall_new or new_connections
        if seconds is not None:
            self._stall_ends.append(self._loop.call_later(seconds, self._end_stall, chosen, new_connections))
        return len(chosen)

    def _end_stall(self, links: list[_Link], new_connections: bool) -> None:
        for link in links:
            link.flowing.set()
        if new_connections:  # connections accepted during a stall of the whole link stalled too
            self._stall_new = False
            for link in self._links:
                link.flowing.set()

    async def _resume(self) -> None:
        for handle in self._stall_ends:
            handle.cancel()
        self._stall_ends.clear()
        self._end_stall(list(self._links), True)

    async def _cut(self, how: str, identity: bytes | None) -> int:
        chosen = [link for link in self._links if identity is None or link.identity == identity]
        for link in chosen:
            self._links.discard(link)
            if how == "reset":
                self._drop(link, reset=True)
            else:
                for pump in link.pumps:
                    pump.cancel()
                self._held.append(link)
        return len(chosen)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._refuse:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)  # the target is down (a trainer restarting): the peer sees a refusal
            return
        link = _Link(writer, up_writer)
        if not self._stall_new:
            link.flowing.set()
        self._links.add(link)
        link.pumps = [asyncio.create_task(self._pump(reader, up_writer, link, sniff=True)),
                      asyncio.create_task(self._pump(up_reader, writer, link, sniff=False))]

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, link: _Link, sniff: bool) -> None:
        """Forward ``src`` to ``dst`` under the faults in force; an EOF is passed on as one, an error
        on either side resets both."""
        try:
            while True:
                await link.flowing.wait()  # a stalled link reads nothing: the kernel buffers fill
                data = await src.read(CHUNK if self._rate is None else max(1, min(CHUNK, int(self._rate / 20))))
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    break
                if sniff and link.identity is None:
                    link.identity = _read_identity(link, data)
                if self._delay_s:
                    await asyncio.sleep(self._delay_s)
                await link.flowing.wait()  # a stall that began while this chunk was held
                dst.write(data)
                await dst.drain()
                self.forwarded += len(data)
                if self._rate is not None:
                    await asyncio.sleep(len(data) / self._rate)
        except (ConnectionError, OSError):
            if link in self._links:
                self._links.discard(link)
                self._drop(link, reset=True)
            return
        if all(p.done() or p is asyncio.current_task() for p in link.pumps) and link in self._links:
            self._links.discard(link)  # both directions ended with an EOF: close normally
            self._drop(link, reset=False)

    def _drop(self, link: _Link, reset: bool) -> None:
        for pump in link.pumps:
            if pump is not asyncio.current_task():
                pump.cancel()
        for writer in (link.client, link.upstream):
            if reset:
                _reset(writer)
            else:
                writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with RST: ``SO_LINGER`` on with 0 s, then close without flushing."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _read_identity(link: _Link, data: bytes) -> bytes | None:
    """The routing id in a ZMTP ``READY``'s ``Identity`` property among the peer's first bytes, once
    they hold it (``name-size name value-size(4, big-endian) value``); None until then, and for good
    after the first KiB."""
    if len(link.sniffed) >= 1024:
        return None
    link.sniffed = (link.sniffed + data)[:1024]
    at = link.sniffed.find(_IDENTITY)
    if at < 0 or len(link.sniffed) < at + len(_IDENTITY) + 4:
        return None
    start = at + len(_IDENTITY) + 4
    (size,) = struct.unpack(">I", link.sniffed[at + len(_IDENTITY):start])
    if len(link.sniffed) < start + size:
        return None
    return link.sniffed[start:start + size]


if __name__ == "__main__":
    import sys

    sys.exit("fault_proxy.py is a module for the tests and bench_chaos.py --network, not a command: "
             "import FaultProxy (its docstring says how), or run bench_chaos.py --network")
