"""A transport that never loses data silently, on one ROUTER or DEALER ``zmq.asyncio`` socket.

* **Sequence numbers.** Every data message to a peer carries the next number of the sender's
  stream to that peer, and that stream's session id (random per stream: a new process incarnation,
  or a new stream after :meth:`Channel.forget`, which numbers from 0 again — a receiver that saw
  the old stream must not take the new one's numbers for duplicates). The receiver expects each
  peer's numbers to go up by one; a gap (messages lost,
  e.g. queued to a connection that died) or a duplicate raises :class:`SequenceError`. Control
  messages (:data:`~specroll.protocol.messages.CONTROL_MESSAGES`: credit, heartbeat, dead) are not
  numbered, so receiving credit never triggers more credit and a heartbeat never takes a data
  slot; they carry the number of the next data message, so a lost tail shows when one arrives.
  The first message of a session is taken as its start and flagged ``Received.first``: that is
  how a peer's restart shows, and the actor protocol answers it (a first message must be ``Hello``).
* **Credit.** A receiver lets a peer send data messages numbered below a limit it grants with
  cumulative :class:`~specroll.protocol.messages.Credit` messages: ``limit = next expected number
  + window``, granted on a peer's first message and again whenever half a window was consumed
  (handed out by :meth:`Channel.recv`). A sender waits in :meth:`Channel.send` while its next
  number is at the limit; the initial limit is ``window`` (both ends are built with the same
  window), and a peer's restart grants a fresh window. Control messages never wait. So a slow
  receiver holds at most ``window`` data messages per peer in its queues: keep it below the HWM
  so the window, not the HWM, is what stops a sender.

Usage: one task per socket calls :meth:`Channel.recv` in a loop (it also consumes credit
grants, so a sender waiting for credit needs that task running); any task may :meth:`Channel.send`.
The coordinator's ROUTER channel addresses generators by identity (``peer=``), gives new groups to
those with free capacity (``Heartbeat``), and answers a :class:`ProtocolError` from ``recv`` with
an ``Error`` when :meth:`Channel.can_send` says it would not wait, and logs it otherwise.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import torch
import zmq
import zmq.asyncio

from specroll.protocol.codec import MAX_HEADER_BYTES, ProtocolError, decode, encode
from specroll.protocol.messages import CONTROL_MESSAGES, Credit

M = TypeVar("M")

DEFAULT_WINDOW = 64
"""Data messages a sender may have unconsumed at one receiver (keep it well below the HWM)."""


@dataclass(frozen=True)
class Received(Generic[M]):
    """One message as handed out by :meth:`Channel.recv`."""

    peer: bytes | None
    """Sender's ZeroMQ identity on a ROUTER; None on a DEALER (its one peer)."""
    seq: int
    """The data message's number; for a control message, the number of the next data message."""
    msg: M
    tensors: dict[str, torch.Tensor]
    """Name → writable CPU tensor, for messages with a ``tensors`` field."""
    first: bool
    """First message seen from this peer session: a new peer, or a known one that restarted."""
    fd: int | None = None
    """On a ROUTER, the file descriptor of the connection it came through (ZeroMQ's ``SRCFD``), which
    the socket monitor's ``EVENT_DISCONNECTED`` names when that connection closes; None when unknown."""
    user_id: str | None = None
    """The ZAP ``User-Id`` of the connection it came through: with CURVE, the role kind of the
    sender's key (``protocol/curve.py``); None without an authenticator."""


class SequenceError(ProtocolError):
    """A gap (``seq > expected``: messages ``expected .. seq-1`` never arrived) or a duplicate
    (``seq < expected``). ``received`` is the message that revealed it, still usable on a gap (a
    control message reveals a lost tail; a credit in it is already applied)."""

    def __init__(self, message: str, *, peer: bytes | None, seq: int, expected: int, received: Received[Any]) -> None:
        super().__init__(message, peer=peer, seq=seq)
        self.expected = expected
        self.received = received


@dataclass
class _PeerState:
    window: int
    session: int | None = None
    """The peer's session, once heard from."""
    expected: int = 0
    """Next sequence number expected from the peer."""
    granted: int = 0
    """Largest credit limit granted to the peer."""
    next_seq: int = 0
    """Our next sequence number to the peer."""
    limit: int = -1
    """Our data messages to it may use sequence numbers below this."""
    credit: anyio.Event = field(default_factory=anyio.Event)
    """Set (and replaced) whenever ``limit`` grows."""
    out_session: int = field(default_factory=lambda: secrets.randbits(63))
    """Session id of our stream to the peer (new after ``forget``, when numbering starts over)."""

    def __post_init__(self) -> None:
        self.limit = self.window

    def raise_limit(self, limit: int) -> None:
        if limit > self.limit:
            self.limit = limit
            self.credit.set()
            self.credit = anyio.Event()


class Channel(Generic[M]):
    """Sequenced, credit-flow-controlled messages over a ROUTER or DEALER ``zmq.asyncio`` socket.

    The channel does not own the socket; close it (with ``close_socket``) after the tasks using
    the channel ended.

    Args:
        socket: made by ``make_socket`` from a ``zmq.asyncio.Context``.
        inbound: the tagged union this side receives (e.g. ``ToTrainer``); ``Credit`` must be in it.
        window: data messages a peer may send before our credit; must be equal on both ends.

    Raises:
        ValueError: a socket that is not ROUTER/DEALER, or ``window < 2``.
    """

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        inbound: Any,
        *,
        window: int = DEFAULT_WINDOW,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        kind = socket.getsockopt(zmq.TYPE)
        if kind not in (zmq.ROUTER, zmq.DEALER):
            raise ValueError(f"a Channel needs a ROUTER or DEALER socket (credit flows back), got type {kind}")
        if window < 2:
            raise ValueError(f"window={window}, expected >= 2")
        self.socket = socket
        self.inbound = inbound
        self.window = window
        self.max_header_bytes = max_header_bytes
        self.router = kind == zmq.ROUTER
        self._peers: dict[bytes, _PeerState] = {}

    def _key(self, peer: bytes | None) -> bytes:
        if self.router and not peer:
            raise ValueError("a ROUTER channel needs peer= (the identity of the receiving actor)")
        return peer if self.router else b""  # type: ignore[return-value]

    def _state(self, key: bytes) -> _PeerState:
        st = self._peers.get(key)
        if st is None:
            st = self._peers[key] = _PeerState(self.window)
        return st

    def can_send(self, peer: bytes | None = None) -> bool:
        """True when a data message to ``peer`` would go out now, without waiting for credit."""
        st = self._state(self._key(peer))
        return st.next_seq < st.limit

    def forget(self, peer: bytes | None = None) -> None:
        """Drop all state about ``peer`` (after its ``Dead`` or a heartbeat timeout); senders
        waiting for its credit are woken and see a fresh window."""
        st = self._peers.pop(self._key(peer), None)
        if st is not None:
            st.credit.set()

    async def send(self, msg: Any, *, peer: bytes | None = None, tensors: Sequence[torch.Tensor] = ()) -> int:
        """Send ``msg`` (with the tensors its ``tensors`` refs describe) and return its header's ``seq``.

        A data message waits for credit first (wrap the call in a timeout where the peer may be
        gone). Tensors are sent zero-copy: do not modify them afterwards (send snapshots).

        Raises:
            ValueError: tensors that do not match the refs; no ``peer`` on a ROUTER channel.
            zmq.ZMQError: ``EHOSTUNREACH`` on a ROUTER when ``peer`` is not connected.
        """
        key = self._key(peer)
        st = self._state(key)
        numbered = not isinstance(msg, CONTROL_MESSAGES)
        if numbered:
            while st.next_seq >= st.limit:
                await st.credit.wait()
                st = self._state(key)
        # No await from here to send_multipart, which queues synchronously: seq order is wire order.
        frames = encode(msg, tensors, session=st.out_session, seq=st.next_seq)
        seq = st.next_seq
        if numbered:  # a control message is not numbered: it carries the next number
            st.next_seq += 1
        await self.socket.send_multipart([key, *frames] if self.router else frames, copy=False)
        return seq

    async def send_control_now(self, msg: Any, *, peer: bytes | None = None) -> bool:
        """Send control message ``msg`` (e.g. a last ``Dead``) only if the socket takes it at once;
        never waits. Returns False when it did not: the peer's queue is full (it does not read) or,
        on a ROUTER, the peer is not connected.

        Raises:
            ValueError: ``msg`` is not a control message; no ``peer`` on a ROUTER channel.
        """
        if not isinstance(msg, CONTROL_MESSAGES):
            raise ValueError(f"{type(msg).__name__} is a data message: it waits for credit (use send)")
        key = self._key(peer)
        st = self._state(key)
        frames = encode(msg, session=st.out_session, seq=st.next_seq)
        try:
            await self.socket.send_multipart([key, *frames] if self.router else frames, flags=zmq.DONTWAIT,
                                             copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    async def recv(self, on_idle: Callable[[], None] | None = None, idle_s: float = 0.25) -> Received[M]:
        """The next message from any peer, in each peer's order; credit grants are consumed here.

        Args:
            on_idle: called whenever the socket holds nothing to read — before waiting, and every
                ``idle_s`` seconds while the wait goes on — so a caller knows every message sent
                before that moment was read, also while no message comes at all (a peer's silence
                is then measured by the clock, not by the next arrival).
            idle_s: seconds between two ``on_idle`` calls while waiting.

        Raises:
            SequenceError: a gap or a duplicate (the stream then continues after ``seq``).
            ProtocolError: undecodable frames (``.peer`` set on a ROUTER); an undecodable message's
                number is unknown, so the next one from that peer also reports it as a gap.
        """
        while True:
            if on_idle is not None:
                # poll takes nothing off the socket, so a wait cut short loses no message
                while not self.socket.get(zmq.EVENTS) & zmq.POLLIN:
                    on_idle()
                    await self.socket.poll(int(idle_s * 1000), zmq.POLLIN)
            frames = await self.socket.recv_multipart(copy=False)
            peer = bytes(frames[0]) if self.router else None
            body = frames[1:] if self.router else frames
            try:
                d = decode(body, self.inbound, max_header_bytes=self.max_header_bytes)
            except ProtocolError as e:
                e.peer = peer
                raise
            key = peer or b""
            st = self._state(key)
            first = st.session != d.session
            if first:
                if st.session is not None:  # the peer restarted: it holds none of our messages
                    st.raise_limit(st.next_seq + self.window)
                st.session, st.expected, st.granted = d.session, d.seq, 0
            received: Received[M] = Received(peer, d.seq, d.msg, d.tensors, first, _source_fd(frames[0]),
                                             _user_id(body[0]) if body else None)
            expected = st.expected
            control = isinstance(d.msg, CONTROL_MESSAGES)
            # A control message is not numbered (credit never begets credit) but follows every message below its seq.
            st.expected = max(expected, d.seq if control else d.seq + 1)
            if isinstance(d.msg, Credit):
                st.raise_limit(d.msg.limit)
            await self._grant(peer, st, force=first)
            if d.seq > expected or (d.seq < expected and not control):
                what = f"gap: messages {expected}..{d.seq - 1} never arrived" if d.seq > expected else "duplicate"
                raise SequenceError(
                    f"peer {peer!r}: {type(d.msg).__name__} has seq {d.seq}, expected {expected} ({what})",
                    peer=peer,
                    seq=d.seq,
                    expected=expected,
                    received=received,
                )
            if not isinstance(d.msg, Credit):
                return received

    async def _grant(self, peer: bytes | None, st: _PeerState, *, force: bool) -> None:
        limit = st.expected + self.window
        if not force and limit - st.granted < max(1, self.window // 2):
            return
        # Never wait here: a peer that does not read (its queue to us full) must not stall the
        # receive task of every peer. A grant that cannot go out now is retried on the peer's next
        # message (``granted`` only moves when one went out); credit is cumulative.
        frames = encode(Credit(limit=limit), session=st.out_session, seq=st.next_seq)
        try:
            await self.socket.send_multipart([self._key(peer), *frames] if self.router else frames,
                                             flags=zmq.DONTWAIT, copy=False)
        except zmq.Again:
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return  # the peer disconnected: nothing to grant to
        st.granted = limit


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP ``User-Id`` of the connection ``frame`` arrived on; None when there is none (no
    authenticator: libzmq reports an empty one)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None
    return user or None


def _source_fd(frame: zmq.Frame) -> int | None:
    """The file descriptor of the connection ``frame`` arrived on, or None (inproc, or unsupported)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError):
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None
