"""What the rollout client does with each message a peer sends: the receive loop, the handshake,
one handler per role (generator, drafter trainer), and forgetting a peer that is gone.

:class:`ClientReceive` is the receiving half of :class:`~specroll.actors.trainer.client.RolloutClient`
(which inherits it): the state it reads and writes is the client's, declared below. The receive
loop never waits on a send: replies go through the peers' outboxes, so credit grants are always read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import zmq
import zmq.asyncio

from specroll.actors.trainer.drafter_relay import DrafterRelay
from specroll.actors.trainer.foreign_groups import ForeignGroups
from specroll.actors.trainer.peer_liveness import PeerLiveness
from specroll.actors.trainer.peer_outboxes import Outboxes
from specroll.actors.trainer.timeline import Timeline
from specroll.actors.trainer.weights_groups import WeightsGroups
from specroll.actors.trainer.weights_publish import PublishedWeights
from specroll.actors.wakeup import Wakeup
from specroll.protocol.channel import Channel, Received, SequenceError
from specroll.protocol.codec import ProtocolError
from specroll.protocol.curve import RefusalLog, ServerKeys
from specroll.protocol.limits import MAX_SEQS, LimitExceeded, check_at_most, check_token_ids
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AckDrafter,
    AckWeights,
    Dead,
    Error,
    FetchDrafter,
    FetchWeights,
    Heartbeat,
    Hello,
    JoinWeightsGroup,
    PublishDrafter,
    Refuse,
    RolloutChunk,
    Stats,
    WeightsGroup,
    WeightsTransport,
    Welcome,
)
from specroll.rl.coordinator import ChunkError, RolloutCoordinator, check_chunk_group_id

log = logging.getLogger("specroll.client")


class ClientReceive:
    """The receiving half of the rollout client (see the module docstring)."""

    actor_id: str
    coordinator: RolloutCoordinator
    drafters: DrafterRelay
    on_chunk: Callable[[str, RolloutChunk], None] | None
    generator_stats: dict[str, Stats]
    dead_generators: list[str]
    drafter_policy_versions: dict[str, int]
    protocol_errors: int
    timeline: Timeline | None
    vocab_size: int | None
    _foreign: ForeignGroups
    _weights: PublishedWeights
    weights_groups: WeightsGroups
    _channel: Channel[Any] | None
    _outboxes: Outboxes | None
    _load: dict[str, tuple[int, int]]
    _liveness: PeerLiveness
    _socket: zmq.asyncio.Socket | None
    curve: ServerKeys | None
    refusals: RefusalLog
    _capacity_known: set[str]
    _finished_event: Wakeup
    _version_event: Wakeup
    _generators_event: Wakeup

    if TYPE_CHECKING:  # the client's own methods, which this half calls (declared for type checkers only)

        def _queue(self, actor: str, msg: Any, tensors: list[torch.Tensor] | None = None) -> None: ...

        def _dispatch(self) -> None: ...

    def _generator_gone(self, actor: str, why: str) -> None:
        """A generator or drafter trainer died or left: forget it (a generator's groups resume elsewhere)."""
        if actor in self.drafters.drafters:
            self.drafters.remove(actor)
            self.drafter_policy_versions.pop(actor, None)
            self._forget(actor)
            log.warning("drafter trainer %s is gone (%s); generators keep the drafter they serve", actor, why)
            return
        if actor not in self.coordinator.generators:
            return
        self.drafters.remove(actor)
        self._load.pop(actor, None)
        orphans = self.coordinator.remove_generator(actor)
        self._capacity_known.discard(actor)
        self.dead_generators.append(actor)
        self.weights_groups.forget(actor)
        self._forget(actor)
        self._version_event.notify()  # one fewer generator to wait for
        log.warning("generator %s is gone (%s); %d groups resume elsewhere", actor, why, len(orphans))
        self._dispatch()

    def _lost_messages(self, peer: bytes | None, expected: int, seq: int) -> bool:
        """A registered peer's messages ``expected .. seq-1`` never arrived (its connection dropped
        and came back: a trainer paused past the ZeroMQ heartbeat, a network partition). What the
        lost chunks carried would leave its groups with a gap no later chunk can fill, so the peer
        is treated as gone — its groups resume elsewhere from the tokens held — and told
        ``unknown_peer``, on which it registers again with ``Hello``. Returns whether the message
        that revealed the gap is to be dropped (it came from such a peer)."""
        actor = (peer or b"").decode(errors="replace")
        if actor not in self.coordinator.generators and actor not in self.drafters.drafters:
            return False
        self._generator_gone(actor, f"its messages {expected}..{seq - 1} never arrived")
        self._queue(actor, Error(code="unknown_peer", message=f"your messages {expected}..{seq - 1} never "
                                 "arrived; send Hello to register again"))
        return True

    def _forget(self, actor: str) -> None:
        """Drop a gone peer's liveness, outbox and channel state."""
        self._liveness.remove(actor)
        if self._outboxes is not None:
            self._outboxes.forget(actor)
        if self._channel is not None:
            self._channel.forget(actor.encode())

    async def _receive_loop(self) -> None:
        assert self._channel is not None
        def drained() -> None:  # the socket is empty: every message sent before now was read
            self._liveness.drained(time.monotonic())

        while True:
            try:
                received = await self._channel.recv(on_idle=drained)
            except SequenceError as e:
                self.protocol_errors += 1
                log.warning("%s", e)
                received = e.received
                if received.seq < e.expected and not received.first:
                    continue  # a duplicate: already handled once
                if not received.first and self._lost_messages(received.peer, e.expected, received.seq):
                    continue
            except ProtocolError as e:
                self.protocol_errors += 1
                actor = e.peer.decode(errors="replace") if e.peer else "?"
                log.warning("malformed message from %s: %s", actor, e)
                if actor in self.coordinator.generators and self._channel.can_send(e.peer):
                    self._queue(actor, Error(code="malformed", message=str(e)[:500], seq=e.seq))
                continue
            actor = (received.peer or b"").decode(errors="replace")
            if self.curve is not None and not self._key_speaks_for(actor, received):
                continue
            self._liveness.heard(actor, received.fd, time.monotonic())
            try:
                self._handle(actor, received.msg, received.tensors, received.fd)
            except (ChunkError, LimitExceeded) as e:
                self.protocol_errors += 1
                log.warning("%s from %s refused: %s", type(received.msg).__name__, actor, e)
                self._queue(actor, Error(code="bad_request", message=str(e)[:500], seq=received.seq))

    def _key_speaks_for(self, actor: str, received: Received[Any]) -> bool:
        """With CURVE: whether the role kind of the sender's key (its ZAP ``User-Id``) is the role
        the message speaks as — the ``Hello`` role, or the role ``actor`` registered with. A
        generator's key cannot register as a drafter trainer nor take a drafter trainer's routing id
        over; the refusal is logged once, a refused ``Hello`` answered with ``Refuse``. Messages of
        peers that never registered go on to be refused as before."""
        msg = received.msg
        if isinstance(msg, Hello):
            claimed = msg.role
        elif actor in self.drafters.drafters:
            claimed = "drafter"
        elif actor in self.coordinator.generators:
            claimed = "generator"
        else:
            return True
        key_role = received.user_id
        if key_role == claimed:
            return True
        self.protocol_errors += 1
        self.refusals.refused(f"role:{key_role}:{claimed[:32]}",
                              f"refused {actor[:80]}: its key is the run's {key_role!r} key, and it speaks as "
                              f"{claimed[:32]!r}")
        if isinstance(msg, Hello):
            self._queue(actor, Refuse(reason=f"your key is this run's {key_role!r} key; a {claimed[:32]!r} needs "
                                             f"the {claimed[:32]!r} key (--keys)"))
        return False

    def _handle(self, actor: str, msg: Any, tensors: dict[str, torch.Tensor], fd: int | None = None) -> None:
        if isinstance(msg, Hello):
            self._on_hello(actor, msg, fd)
            return
        if actor in self.drafters.drafters:
            self._handle_drafter(actor, msg, tensors)
            return
        if actor not in self.coordinator.generators:
            if not isinstance(msg, Dead):
                self.protocol_errors += 1
                log.info("%s from %s, which never said Hello: refused", type(msg).__name__, actor)
                self._queue(actor, Error(code="unknown_peer", message="send Hello first"))
            return
        match msg:
            case RolloutChunk():
                check_chunk_group_id(msg)  # before the id is parsed or echoed in an Abort
                if self._foreign.is_foreign(msg.group_id):
                    self._on_foreign_chunk(actor, msg.group_id)
                    return
                self._check_chunk_tokens(msg)  # before a token is held, resumed elsewhere or trained on
                finished = self.coordinator.on_chunk(actor, msg)
                self.drafters.on_chunk(msg)
                if finished is not None:
                    if self.timeline is not None:
                        self.timeline.record("group_finished", group_id=finished.group_id, lane=finished.lane)
                    if finished.lane == "train":  # evaluation rollouts are not the drafter's data
                        self.drafters.on_group_finished(finished)
                    self._finished_event.notify()
                if self.on_chunk is not None:
                    self.on_chunk(actor, msg)
            case Heartbeat():
                for field, value in (("batch_size", msg.batch_size), ("free_seqs", msg.free_seqs),
                                     ("free_groups", msg.free_groups)):
                    check_at_most(f"Heartbeat.{field}", value, MAX_SEQS, "protocol limit")
                self.coordinator.on_heartbeat(actor, msg.free_groups, msg.policy_version, msg.free_seqs)
                self._load[actor] = (msg.batch_size, msg.batch_size + msg.free_seqs)
                if self.timeline is not None:
                    self.timeline.record("generator_load", actor=actor, live=msg.batch_size,
                                         capacity=msg.batch_size + msg.free_seqs)
                if actor not in self._capacity_known:
                    self._capacity_known.add(actor)
                    self._generators_event.notify()
                self._version_event.notify()  # a heartbeat may report a newer served version
                self._dispatch()
            case FetchWeights():
                self._on_fetch(actor, msg.version, msg.transport)
            case JoinWeightsGroup():
                if self._weights.transport == "collective":
                    self.weights_groups.join(actor, msg)
                else:
                    self._queue(actor, WeightsGroup(name="", host="", port=0, refused="this trainer sends weights as "
                                                    "chunks (network.weights_transport = zmq)"))
            case AckWeights():
                self.coordinator.on_served(actor, msg.version)
                if self.timeline is not None:
                    self.timeline.record("policy_served", actor=actor, version=msg.version)
                self._version_event.notify()
            case Stats():
                self.generator_stats[actor] = msg
            case Error():
                log.warning("generator %s reports %s: %s", actor, msg.code, msg.message[:500])
            case Dead():
                self._generator_gone(actor, f"it exited ({msg.reason or 'no reason given'})")
            case FetchDrafter():
                self.drafters.on_fetch(actor, msg)
            case AckDrafter():
                self.drafters.on_ack(actor, msg)
            case _:
                self.protocol_errors += 1
                self._queue(actor, Error(code="bad_request", message=f"{type(msg).__name__} is not for a generator "
                                                                     "to send"))

    def _handle_drafter(self, actor: str, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        match msg:
            case PublishDrafter():
                self.drafters.on_publish(actor, msg, tensors)
                self.drafters.announce_to(list(self.coordinator.generators))
            case FetchWeights():
                self._on_fetch(actor, msg.version)
            case AckWeights():
                self.drafter_policy_versions[actor] = msg.version
            case Heartbeat() | Stats():
                pass
            case Error():
                log.warning("drafter trainer %s reports %s: %s", actor, msg.code, msg.message[:500])
            case Dead():
                self._generator_gone(actor, f"it exited ({msg.reason or 'no reason given'})")
            case _:
                self.protocol_errors += 1
                self._queue(actor, Error(code="bad_request", message=f"{type(msg).__name__} is not for a drafter "
                                                                     "trainer to send"))

    def _check_chunk_tokens(self, chunk: RolloutChunk) -> None:
        """Refuse token ids outside the policy's vocabulary: the training step's embedding lookup
        would raise on them (ending the trainer), and a group resumed from them would be refused by
        every generator. Nothing is checked when :attr:`vocab_size` is None (no model known yet).

        Raises:
            LimitExceeded: an id outside ``[0, vocab_size)``; the message names the group, the sample,
                the id's index and value, and the range.
        """
        if self.vocab_size is None:
            return
        try:
            check_token_ids("RolloutChunk.token_ids", chunk.token_ids, self.vocab_size)
        except LimitExceeded as e:  # the group id is at most MAX_ID_CHARS (check_chunk_group_id)
            raise LimitExceeded(f"group {chunk.group_id!r} sample {chunk.sample_index}: {e}") from None

    def _on_foreign_chunk(self, actor: str, group_id: str) -> None:
        """Stop a group this client does not know on the generator that runs it (once per group
        and generator), instead of letting it use capacity until its ``max_tokens``."""
        if self._foreign.first_chunk(actor, group_id):
            log.info("generator %s streams group %s, unknown here (an earlier client's?); aborting it", actor,
                     group_id)
            self._queue(actor, Abort(group_id=group_id))

    def _on_hello(self, actor: str, msg: Hello, fd: int | None) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self._queue(actor, Refuse(reason=f"protocol version {msg.protocol_version}, this trainer speaks "
                                             f"{PROTOCOL_VERSION}; run the same specroll version on both"))
            return
        if msg.role not in ("generator", "drafter"):
            self._queue(actor, Refuse(reason=f"role {msg.role!r}: this endpoint serves 'generator' and 'drafter'"))
            return
        if msg.role == "drafter":
            if actor in self.drafters.drafters:
                self._generator_gone(actor, "it said Hello again")
            self.drafters.add_drafter(actor)
            self._liveness.add(actor, time.monotonic(), fd)
            self._queue(actor, Welcome(protocol_version=PROTOCOL_VERSION, actor_id=self.actor_id))
            if self._weights.announcement is not None:
                self._queue(actor, self._weights.announcement)
            self.drafters.on_generator_hello(actor)  # a restarted drafter trainer numbers above it
            return
        if actor in self.coordinator.generators:  # it restarted under the same id: its groups are gone
            self._generator_gone(actor, "it said Hello again")
        self.coordinator.add_generator(actor)
        self._liveness.add(actor, time.monotonic(), fd)
        self._queue(actor, Welcome(protocol_version=PROTOCOL_VERSION, actor_id=self.actor_id))
        if self._weights.announcement is not None:
            self._queue(actor, self._weights.announcement)
        self.drafters.on_generator_hello(actor)

    def _on_fetch(self, actor: str, version: int, transport: WeightsTransport = "zmq") -> None:
        if transport == "collective" and self._weights.transport == "collective":
            self.weights_groups.fetch(actor, version)  # over its group, or chunks when it has none
        else:
            self._send_chunks(actor, version)

    def _send_chunks(self, actor: str, version: int) -> None:
        """Answer a fetch of ``version`` with its chunks (or the ``Error`` naming the current version)."""
        for msg, tensors in self._weights.answer_fetch(version):
            self._queue(actor, msg, tensors)
