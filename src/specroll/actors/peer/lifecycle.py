"""The lifecycle of a peer actor's connection to the trainer, shared by a generator and the drafter
trainer; what differs between them is a :class:`PeerRole`.

:class:`PeerConnection` owns the channel and runs, in one anyio task group:

* **receive** — the channel's one receive task: a ``SequenceError`` or ``ProtocolError`` is logged
  and answered with ``Error`` when that would not wait for credit; the handshake and the
  connection's own messages (``Welcome``, ``Refuse``, ``Credit``, ``Error``, ``Dead``) are handled
  here, every other message goes to :meth:`PeerRole.on_message`;
* **send** — drains the outbox (a deque; :meth:`put` never waits) through the channel, waiting for
  the trainer's credit;
* **tick** — a :meth:`PeerRole.heartbeat` every ``heartbeat_s`` (then :meth:`PeerRole.on_tick`);
* **watchdog** and **connection monitor** (:class:`TrainerLiveness`): exit 3 when the trainer is
  unreachable for ``reconnect_timeout_s``, exit 0 when it said ``Dead`` and did not come back
  within ``trainer_timeout_s``;
* **signals** — SIGTERM/SIGINT: with ``graceful_signals`` the first lets the role's main loop end
  (and the outbox flush, at most ``linger_s``), a second stops at once; without, the first stops at once.

Handshake: ``Hello`` → ``Welcome`` (same protocol version: the role's main loop,
:meth:`PeerRole.serve`, starts) | ``Refuse`` (exit 2) | nothing within ``trainer_timeout_s`` (exit 3).
Whatever ends the actor, the trainer is told why with ``Dead`` (:func:`report_exit`) and the first
reason given decides the exit code (:mod:`specroll.actors.shared.exit_codes`).

A new trainer on the same endpoint (restarted on its run directory) knows nothing of this peer, so the
peer registers again. After the trainer's ``Dead`` it answers ``Hello`` at once (which tells the exiting
trainer that its ``Dead`` was read: it may close now) and again as the first thing the next connection
carries; after a trainer that died without ``Dead``, the sign is the new trainer's ``unknown_peer``
answer to what reached it, as from a trainer that forgot this peer (a new trainer session alone is not:
a trainer sending from stray sessions is refused, not re-registered with). A gap in the trainer's stream
is the third sign: messages the trainer could not route while this peer's connection was gone, or lost
with a reset one, may have carried work (a ``SubmitGroup``) it counts as this peer's and would wait for
without end; the message after the gap is not read (the trainer writes off, then resends, what it gave
this peer). A gap no wider than the messages just refused as malformed is no loss. In each case the peer
is no longer welcomed: it drops its outbox (nothing in it is for the new trainer) and starts its stream
over (a fresh window), sends no heartbeat and queues nothing but ``Hello`` until the next ``Welcome``,
which it takes as the new trainer's; the role drops what it held of the old incarnation
(:meth:`PeerRole.on_new_trainer`; a generator drops its live groups, which that trainer resumes from
what it holds). A chunk that was on its way still reaches a new trainer as foreign, and is aborted there
(``actors/rollout/foreign_groups.py``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar, assert_never

import anyio
import anyio.abc
import torch

from specroll.actors.peer.exit import failure, report_exit
from specroll.actors.peer.trainer_liveness import TrainerLiveness
from specroll.actors.shared.exit_codes import EXIT_OK, EXIT_PEER_LOST, EXIT_REFUSED
from specroll.actors.shared.wakeup import Wakeup
from specroll.protocol.channel import Channel, Received, SequenceError
from specroll.protocol.codec import ProtocolError
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Credit,
    Dead,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Refuse,
    Welcome,
)

M = TypeVar("M")

ConnectionMessage = Welcome | Refuse | Credit | Error | Dead
"""What :class:`PeerConnection` handles itself; a role's ``on_message`` never sees these."""

_MAX_ERROR_TEXT = 500
"""Characters of an ``Error`` message at most (a refused frame's description can be long)."""


class PeerRole(Protocol[M]):
    """What a peer actor adds to the shared lifecycle (a generator, the drafter trainer)."""

    async def on_message(self, r: Received[M]) -> None:
        """Handle one message of the role (never a :data:`ConnectionMessage`); must not wait for credit."""
        ...

    async def serve(self) -> None:
        """The role's main loop, started once welcomed; returning ends the actor gracefully."""
        ...

    def flush(self) -> None:
        """A graceful stop: queue (:meth:`PeerConnection.put`) what was produced and not yet sent."""
        ...

    def heartbeat(self) -> Heartbeat:
        """The heartbeat to send now."""
        ...

    def on_tick(self) -> None:
        """Called after each heartbeat (periodic reports)."""
        ...

    def on_new_trainer(self) -> None:
        """The trainer restarted or forgot this peer: drop what belongs to its old incarnation (transfers
        under way, announced versions: a new trainer numbers its own), before the new ``Hello``."""
        ...


class PeerConnection(Generic[M]):
    """One peer actor's connection to the trainer and its lifecycle (module docstring).

    Args:
        channel: a DEALER channel connected to the trainer, inbound union ``M``.
        role: the ``Hello`` role (``"generator"``, ``"drafter"``).
        name: the role in log lines (``"generator"``, ``"drafter trainer"``).
        actor_id: this process's id (``Hello``, ``Dead``, log lines).
        endpoint: the trainer's endpoint (log lines).
        heartbeat_s: seconds between heartbeats.
        trainer_timeout_s: the handshake's limit and the time a trainer that said ``Dead`` has to
            come back, in seconds.
        reconnect_timeout_s: the time a trainer that vanished without ``Dead`` has to come back
            (None: ``trainer_timeout_s``).
        linger_s: on a graceful stop, seconds to flush the outbox, then seconds to deliver ``Dead``.
        log: the actor's logger.
        capabilities: ``Hello.capabilities``.
        graceful_signals: the first SIGTERM/SIGINT ends the role's main loop (a second stops now);
            ``False``: the first stops now.
    """

    def __init__(self, channel: Channel[M], *, role: str, name: str, actor_id: str, endpoint: str,
                 heartbeat_s: float, trainer_timeout_s: float, linger_s: float, log: logging.Logger,
                 capabilities: tuple[str, ...] = (), graceful_signals: bool = False,
                 reconnect_timeout_s: float | None = None) -> None:
        self.channel = channel
        self.role, self.name, self.actor_id, self.endpoint = role, name, actor_id, endpoint
        self.heartbeat_s, self.trainer_timeout_s, self.linger_s = heartbeat_s, trainer_timeout_s, linger_s
        self.log = log
        self.capabilities = capabilities
        self.refusals: Counter[str] = Counter()
        """Inbound messages refused, by error code (``specroll:refusals``)."""
        self.graceful_signals = graceful_signals
        self.trainer = TrainerLiveness(endpoint, trainer_timeout_s, log, on_connected=self._on_connected,
                                       on_refused=lambda why: self.stop(EXIT_REFUSED, why),
                                       reconnect_s=reconnect_timeout_s)
        self.wake = Wakeup()
        """The role's main loop waits on this; role dispatch and :meth:`stop` notify it."""
        self.outbox_changed = Wakeup()
        """Notified whenever a message is queued or sent, and on :meth:`stop`."""
        self.stopping = False
        """A stop was asked for: the role's main loop should end."""
        self._outbox: deque[tuple[object, Sequence[torch.Tensor]]] = deque()
        self._sending: anyio.CancelScope | None = None
        """The send of the outbox's first message, while it is under way."""
        self._welcomed = anyio.Event()
        self._last_hello = 0.0
        self._malformed = 0  # messages refused as malformed since the last one read: a gap that is no loss
        self._hello_on_connect = False
        """The trainer said ``Dead``: a new connection is a new trainer, to greet with ``Hello``."""
        self._role: PeerRole[M] | None = None
        self._exit: tuple[int, str] | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def welcomed(self) -> bool:
        """The trainer answered ``Hello`` with ``Welcome``."""
        return self._welcomed.is_set()

    @property
    def queued(self) -> int:
        """Messages in the outbox (the one being sent included)."""
        return len(self._outbox)

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self, role: PeerRole[M]) -> int:
        """Serve ``role`` until a signal, a refusal, the trainer's loss or the end of its main loop;
        send ``Dead``; return the exit code (:mod:`specroll.actors.shared.exit_codes`)."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg, self._role = tg, role
                tg.start_soon(self._receive_loop, role)
                tg.start_soon(self._send_loop)
                tg.start_soon(self.trainer.watchdog, self._trainer_lost)
                tg.start_soon(self.trainer.watch_connection, self.channel.socket)
                await tg.start(self._watch_signals)  # watched before the Hello: a stop is never half-seen
                await self._handshake()
                tg.start_soon(self._tick, role)
                await role.serve()
                with anyio.move_on_after(self.linger_s):  # graceful stop: flush what was produced
                    role.flush()
                    while self._outbox or self._sending is not None:
                        await self.outbox_changed.wait()
                tg.cancel_scope.cancel()
        except Exception as e:  # an internal failure: reported as the actor's death
            self.log.exception("%s %s failed", self.name, self.actor_id)
            self._exit = failure(e)
        return await report_exit(self.channel, self.actor_id, self._exit, self.linger_s, self.log, self.name)

    def stop(self, code: int, reason: str, *, graceful: bool = False) -> None:
        """End the actor: ``graceful`` lets the role's main loop end (it sees :attr:`stopping`) and
        flushes, once welcomed; otherwise every task is cancelled now. The first reason given is the one reported."""
        if self._exit is None:
            self._exit = (code, reason)
        self.stopping = True
        self.wake.notify()
        self.outbox_changed.notify()
        # Before the trainer's Welcome there is no step to finish and nothing it would accept to
        # flush: a graceful stop is immediate (it would otherwise wait out the whole handshake).
        if (not graceful or not self.welcomed) and self._tg is not None:
            self._tg.cancel_scope.cancel()

    def _register_again(self, why: str) -> None:
        """The trainer restarted, is exiting or forgot us (module docstring): no longer welcomed, the
        role's state of the old incarnation dropped; the outbox dropped (a send under way too: it may
        wait for credit the old trainer will never grant) and our stream started over with a fresh
        window (:meth:`Channel.forget`); then ``Hello``."""
        if self.welcomed:
            self.log.info("%s: registering again with the trainer at %s", why, self.endpoint)
            self._welcomed = anyio.Event()
            if self._role is not None:
                self._role.on_new_trainer()
        if self._sending is not None:
            self._sending.cancel()
        self._outbox.clear()
        self.channel.forget()
        self.outbox_changed.notify()
        self._send_hello()

    def _on_connected(self) -> None:
        """A connection to the trainer's endpoint came up (the socket monitor): after the trainer's
        ``Dead`` it is a new trainer, greeted with ``Hello`` unless one is queued already (it goes
        out on this connection)."""
        if self._hello_on_connect and not self.welcomed and not self._outbox:
            self._send_hello()

    async def _handshake(self) -> None:
        self._send_hello()
        welcomed = self._welcomed  # the first Welcome; a trainer's Dead right after it replaces the event
        with anyio.move_on_after(self.trainer_timeout_s):
            await welcomed.wait()
        if not welcomed.is_set():
            self.stop(EXIT_PEER_LOST, f"no Welcome from the trainer at {self.endpoint} within "
                      f"{self.trainer_timeout_s} s{self.trainer.why_unreached()}")
            await anyio.sleep_forever()

    def _send_hello(self) -> None:
        self._last_hello = time.monotonic()
        self.put(Hello(protocol_version=PROTOCOL_VERSION, role=self.role, actor_id=self.actor_id,
                       capabilities=self.capabilities))

    async def _watch_signals(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.graceful_signals:
                    self.stop(EXIT_OK, f"received {name}")
                elif self.stopping:
                    self.log.warning("second %s: stopping now", name)
                    self.stop(EXIT_OK, f"received {name}")
                else:
                    self.log.info("received %s: stopping after this step", name)
                    self.stop(EXIT_OK, f"received {name}", graceful=True)

    def _trainer_lost(self, ended: bool, reason: str) -> None:
        self.stop(EXIT_OK if ended else EXIT_PEER_LOST, reason)

    # ---- sending ----------------------------------------------------------------------------

    def put(self, msg: object, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Queue ``msg`` (with the tensors its refs describe) for the trainer; never waits. Until the
        trainer's ``Welcome`` only ``Hello`` is queued: a trainer that does not know us refuses the rest."""
        if not self.welcomed and not isinstance(msg, Hello):
            self.log.debug("not welcomed: %s dropped", type(msg).__name__)
            return
        self._outbox.append((msg, tensors))
        self.outbox_changed.notify()

    async def _send_loop(self) -> None:
        while True:
            while not self._outbox:
                await self.outbox_changed.wait()
            item = self._outbox[0]
            with anyio.CancelScope() as self._sending:  # cancelled when the trainer changes
                await self.channel.send(item[0], tensors=item[1])  # waits for the trainer's credit
            self._sending = None
            if self._outbox and self._outbox[0] is item:  # not dropped meanwhile
                self._outbox.popleft()
            self.outbox_changed.notify()

    async def refuse(self, code: ErrorCode, message: str, seq: int | None = None, group_id: str | None = None) -> None:
        """Log a refused inbound message and answer it with ``Error`` when that would not wait for
        credit (the receive task must never block, or credit would never arrive)."""
        self.log.warning("refused (%s): %s", code, message)
        self.refusals[code] += 1
        if self.channel.can_send():
            await self.channel.send(Error(code=code, message=message[:_MAX_ERROR_TEXT], seq=seq, group_id=group_id))

    async def _tick(self, role: PeerRole[M]) -> None:
        while True:
            await anyio.sleep(self.heartbeat_s)
            if not self.welcomed:
                continue  # a trainer that does not know us (yet) would refuse it
            with anyio.move_on_after(self.heartbeat_s):  # never pile up behind a dead connection
                await self.channel.send(role.heartbeat())
            role.on_tick()

    # ---- receiving --------------------------------------------------------------------------

    async def _receive_loop(self, role: PeerRole[M]) -> None:
        while True:
            try:
                received = await self.channel.recv()
            except SequenceError as e:
                await self.refuse("sequence", str(e), e.seq)
                if e.seq < e.expected:
                    continue  # a duplicate: already handled
                refused, self._malformed = self._malformed, 0
                if self.welcomed and e.seq - e.expected > refused:  # lost: what the trainer thinks we hold, we do not
                    self._register_again(f"messages {e.expected}..{e.seq - 1} from the trainer never arrived")
                    continue
                received = e.received  # the gap is what we refused (the trainer was told), or before the Welcome
            except ProtocolError as e:
                await self.refuse("malformed", str(e), e.seq)
                self._malformed += 1
                continue
            self._malformed = 0
            msg = received.msg
            self.trainer.heard(dead=isinstance(msg, Dead))
            if received.first and self.welcomed:
                self.log.info("a new trainer session (seq %d): the trainer restarted or a stray peer wrote",
                              received.seq)
            if isinstance(msg, Dead):
                # Our Hello tells the exiting trainer we read its Dead (it may close now), or reaches a
                # new trainer already connected; a later connection gets one of its own.
                self._hello_on_connect = True
                self._register_again("the trainer is exiting")
            if isinstance(msg, ConnectionMessage):
                await self._on_connection_message(msg, received.seq)
            else:
                await role.on_message(received)

    async def _on_connection_message(self, msg: ConnectionMessage, seq: int) -> None:
        match msg:
            case Welcome():
                if self.welcomed:
                    await self.refuse("bad_request", f"unexpected Welcome from {msg.actor_id!r}: already welcomed", seq)
                elif msg.protocol_version != PROTOCOL_VERSION:
                    self.stop(EXIT_REFUSED, f"the trainer speaks protocol {msg.protocol_version}, "
                              f"this {self.name} {PROTOCOL_VERSION}")
                else:
                    self.log.info("welcomed by %s", msg.actor_id)
                    self._welcomed.set()
                    self._hello_on_connect = False
            case Refuse():
                if self.welcomed:
                    await self.refuse("bad_request", f"unexpected Refuse after the handshake: {msg.reason}", seq)
                else:
                    self.stop(EXIT_REFUSED, f"refused by the trainer: {msg.reason[:_MAX_ERROR_TEXT]}")
            case Credit():
                pass  # consumed by the channel; never handed out
            case Error():
                about = f" about our message {msg.seq}" if msg.seq is not None else ""
                self.log.warning("the trainer reports an error (%s)%s: %s", msg.code, about,
                                 msg.message[:_MAX_ERROR_TEXT])
                if msg.code == "unknown_peer" and (self.welcomed or time.monotonic() - self._last_hello > 1.0):
                    self._register_again("the trainer does not know us")  # not welcomed: our Hello was lost
            case Dead():
                self.log.info("the trainer (%s) is exiting (%s); waiting for it to come back", msg.actor_id,
                              msg.reason)
            case _:
                assert_never(msg)

