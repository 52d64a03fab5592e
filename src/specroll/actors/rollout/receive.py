"""What the hub does with each message a peer sends: the receive loop, the check that a CURVE key
speaks only as its own role, and one handler per role (generator, drafter trainer).

The receive loop never waits on a send: replies go through the peers' outboxes (the hub's
``send``), so credit grants are always read. It reports every moment its socket is empty to the
liveness rules, so a peer's silence is measured by the clock even when nothing arrives at all.

A chunk that cannot be merged (a token id outside the vocabulary, a gap, a disagreement, tokens past
``max_tokens``) is refused — answered with ``Error``, nothing of it kept — and its group is taken from
the generator that sent it (``Abort``) to resume elsewhere, a failure under the retry rule
(``specroll/rl/group_retries.py``); so is a training or evaluation group its generator refuses. A
generator that sends such chunks cannot hold a group: past ``max_group_retries`` failures the group
is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from specroll.actors.rollout.drafter_relay import DrafterRelay
from specroll.actors.rollout.foreign_groups import ForeignGroups
from specroll.actors.rollout.outboxes import Send
from specroll.actors.rollout.peers import HubEvents, Peers
from specroll.actors.rollout.timeline import Timeline
from specroll.actors.rollout.weights_groups import WeightsGroups
from specroll.actors.rollout.weights_publish import PublishedWeights
from specroll.protocol.channel import Channel, Received, SequenceError
from specroll.protocol.codec import ProtocolError
from specroll.protocol.curve import RefusalLog, ServerKeys
from specroll.protocol.limits import MAX_SEQS, LimitExceeded, check_at_most, check_token_ids
from specroll.protocol.messages import (
    Abort,
    AckDrafter,
    AckResetPrefixCache,
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
)
from specroll.rl.coordinator import ChunkError, RolloutCoordinator, check_chunk_group_id

log = logging.getLogger("specroll.client")


class Receiver:
    """The hub's receiving side (module docstring).

    Args:
        coordinator: the groups the chunks belong to.
        peers: registration, load and liveness of the peers.
        drafters: the drafter trainers and drafter versions.
        weights: the published policy versions (what a fetch is answered from).
        weights_groups: the generators' collective weights groups.
        foreign: recognises chunks of groups this hub never issued, or that their sender no longer serves.
        events: woken when a group finishes or a version is reported.
        send: queues a message for a peer.
        send_chunks: answers a fetch of a policy version with its chunks.
        dispatch: hands queued groups to generators with room.
        curve: with CURVE, the run's keys (a key speaks only as its role); None: no security.
        refusals: where refusals by the security layer are logged once each.
        timeline: where finished groups are recorded (None: nowhere).
        on_chunk: called with ``(actor_id, chunk)`` for every merged chunk (None: nothing is called).
        vocab_size: token ids a chunk may carry are in ``[0, vocab_size)`` (None: not checked).
    """

    def __init__(self, coordinator: RolloutCoordinator, peers: Peers, drafters: DrafterRelay,
                 weights: PublishedWeights, weights_groups: WeightsGroups, foreign: ForeignGroups,
                 events: HubEvents, send: Send, send_chunks: Callable[[str, int], None], dispatch: Callable[[], None],
                 curve: ServerKeys | None, refusals: RefusalLog, timeline: Timeline | None,
                 on_chunk: Callable[[str, RolloutChunk], None] | None = None, vocab_size: int | None = None) -> None:
        self.coordinator, self.peers, self.drafters = coordinator, peers, drafters
        self.weights, self.weights_groups, self.foreign = weights, weights_groups, foreign
        self.events, self._send, self._send_chunks, self._dispatch = events, send, send_chunks, dispatch
        self.curve, self.refusals, self.timeline = curve, refusals, timeline
        self.on_chunk = on_chunk
        """Called with ``(actor_id, chunk)`` for every merged chunk."""
        self.vocab_size = vocab_size
        """Token ids a chunk may carry are in ``[0, vocab_size)``; None: not checked."""
        self.protocol_errors = 0
        """Messages refused: malformed, out of sequence, from a peer without a handshake, or chunks
        that cannot be merged (each logged, and answered with ``Error`` where credit allows)."""

    async def run(self, channel: Channel[Any]) -> None:
        """Receive and handle every message on ``channel`` (runs until cancelled)."""

        def drained() -> None:  # the socket is empty: every message sent before now was read
            self.peers.liveness.drained(time.monotonic())

        while True:
            try:
                received = await channel.recv(on_idle=drained)
            except SequenceError as e:
                self.protocol_errors += 1
                log.warning("%s", e)
                received = e.received
                if received.seq < e.expected and not received.first:
                    continue  # a duplicate: already handled once
                if not received.first and self.peers.lost_messages(received.peer, e.expected, received.seq):
                    continue
            except ProtocolError as e:
                self.protocol_errors += 1
                actor = e.peer.decode(errors="replace") if e.peer else "?"
                log.warning("malformed message from %s: %s", actor, e)
                if actor in self.coordinator.generators and channel.can_send(e.peer):
                    self._send(actor, Error(code="malformed", message=str(e)[:500], seq=e.seq), None)
                continue
            actor = (received.peer or b"").decode(errors="replace")
            if self.curve is not None and not self._key_speaks_for(actor, received):
                continue
            self.peers.liveness.heard(actor, received.fd, time.monotonic())
            try:
                self.handle(actor, received.msg, received.tensors, received.fd)
            except (ChunkError, LimitExceeded) as e:
                self.protocol_errors += 1
                log.warning("%s from %s refused: %s", type(received.msg).__name__, actor, e)
                self._send(actor, Error(code="bad_request", message=str(e)[:500], seq=received.seq), None)
                if isinstance(chunk := received.msg, RolloutChunk):  # its group is taken from the sender
                    self._take_back(actor, chunk.group_id, f"generator {actor} sent a chunk refused: {str(e)[:300]}",
                                    [chunk.sample_index] if chunk.finished else [])

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
            self._send(actor, Refuse(reason=f"your key is this run's {key_role!r} key; a {claimed[:32]!r} needs "
                                            f"the {claimed[:32]!r} key (--keys)"), None)
        return False

    def handle(self, actor: str, msg: Any, tensors: dict[str, torch.Tensor], fd: int | None = None) -> None:
        """Act on one message of ``actor``'s (what came through connection ``fd``).

        Raises:
            ChunkError: a chunk that cannot be merged into its group.
            LimitExceeded: a count or token id over its bound.
        """
        if isinstance(msg, Hello):
            self.peers.on_hello(actor, msg, fd)
            return
        if actor in self.drafters.drafters:
            self._handle_drafter(actor, msg, tensors)
            return
        if actor not in self.coordinator.generators:
            if not isinstance(msg, Dead):
                self.protocol_errors += 1
                log.info("%s from %s, which never said Hello: refused", type(msg).__name__, actor)
                self._send(actor, Error(code="unknown_peer", message="send Hello first"), None)
            return
        match msg:
            case RolloutChunk():
                self._on_chunk(actor, msg)
            case Heartbeat():
                for name, value in (("batch_size", msg.batch_size), ("free_seqs", msg.free_seqs),
                                    ("free_groups", msg.free_groups)):
                    check_at_most(f"Heartbeat.{name}", value, MAX_SEQS, "protocol limit")
                self.coordinator.on_heartbeat(actor, msg.free_groups, msg.policy_version, msg.free_seqs)
                self.peers.on_heartbeat(actor, msg.batch_size, msg.free_seqs)
                if self.timeline is not None:
                    self.timeline.record("generator_load", actor=actor, live=msg.batch_size,
                                         capacity=msg.batch_size + msg.free_seqs)
                self.events.version.notify()  # a heartbeat may report a newer served version
                self._dispatch()
            case FetchWeights():
                self._on_fetch(actor, msg.version, msg.transport)
            case JoinWeightsGroup():
                if self.weights.transport == "collective":
                    self.weights_groups.join(actor, msg)
                else:
                    self._send(actor, WeightsGroup(name="", host="", port=0, refused="this trainer sends weights "
                                                   "as chunks (network.weights_transport = zmq)"), None)
            case AckWeights():
                self.coordinator.on_served(actor, msg.version)
                if self.timeline is not None:
                    self.timeline.record("policy_served", actor=actor, version=msg.version)
                self.events.version.notify()
            case Stats():
                self.peers.generator_stats[actor] = msg
            case AckResetPrefixCache():
                self.peers.prefix_caches.on_ack(actor, msg)
            case Error():
                log.warning("generator %s reports %s: %s", actor, msg.code, msg.message[:500])
                if msg.group_id is not None:
                    self._refused(actor, msg.group_id, msg.message)
            case Dead():
                self.peers.gone(actor, f"it exited ({msg.reason or 'no reason given'})")
            case FetchDrafter():
                self.drafters.on_fetch(actor, msg)
            case AckDrafter():
                self.drafters.on_ack(actor, msg)
            case _:
                self.protocol_errors += 1
                self._send(actor, Error(code="bad_request", message=f"{type(msg).__name__} is not for a generator "
                                                                    "to send"), None)

    def _handle_drafter(self, actor: str, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        match msg:
            case PublishDrafter():
                self.drafters.on_publish(actor, msg, tensors)
                self.drafters.announce_to(list(self.coordinator.generators))
            case FetchWeights():
                self._on_fetch(actor, msg.version)
            case AckWeights():
                self.peers.drafter_policy_versions[actor] = msg.version
            case Heartbeat() | Stats():
                pass
            case Error():
                log.warning("drafter trainer %s reports %s: %s", actor, msg.code, msg.message[:500])
            case Dead():
                self.peers.gone(actor, f"it exited ({msg.reason or 'no reason given'})")
            case _:
                self.protocol_errors += 1
                self._send(actor, Error(code="bad_request", message=f"{type(msg).__name__} is not for a drafter "
                                                                    "trainer to send"), None)

    def _refused(self, actor: str, group_id: str, why: str) -> None:
        """A generator refused a group. A served request's: its samples end now as aborted (as if the
        generator had aborted it), with the reason on the group, for the server to answer. Another
        lane's: a failure under the retry rule (nothing of it runs there), resumed elsewhere or dropped."""
        group = self.coordinator.groups.get(group_id)
        if group is None or group.generator != actor:
            return
        if group.lane != "serve":
            self._take_back(actor, group_id, f"generator {actor} refused it: {why[:300]}", range(len(group.samples)),
                            abort=False)  # nothing of it runs there
            return
        group.refused = why[:500]
        for i, sample in enumerate(group.samples):
            if not sample.finished:
                self._on_chunk(actor, RolloutChunk(group_id=group_id, sample_index=i, offset=len(sample.token_ids),
                                                   token_ids=[], logprobs=[], versions=[], finished=True,
                                                   finish_reason="abort"))

    def _on_chunk(self, actor: str, chunk: RolloutChunk) -> None:
        check_chunk_group_id(chunk)  # before the id is parsed or echoed in an Abort
        stale = self.foreign.stale(actor, chunk.group_id)
        if stale is not None:
            if self.foreign.first_stale_chunk(actor, chunk.group_id) and chunk.finish_reason != "abort":
                # Stop the group on the generator that runs it but no longer serves it (once per group
                # and generator), instead of letting it use capacity until its max_tokens; its tokens
                # are not this hub's (the group is someone else's now, or was never this hub's).
                log.info("generator %s streams group %s, %s; aborting it there", actor, chunk.group_id, stale)
                self._send(actor, Abort(group_id=chunk.group_id), None)
            self.coordinator.on_stale_chunk(actor, chunk)  # a taken-back group's last chunk from it
            return
        self._check_chunk_tokens(chunk)  # before a token is held, resumed elsewhere or trained on
        finished = self.coordinator.on_chunk(actor, chunk)
        self.drafters.on_chunk(chunk)
        if finished is not None:
            if self.timeline is not None:
                self.timeline.record("group_finished", group_id=finished.group_id, lane=finished.lane)
            if finished.lane == "train":  # evaluation rollouts and served requests are not the drafter's data
                self.drafters.on_group_finished(finished)
            self.events.finished.notify()
        if self.on_chunk is not None:
            self.on_chunk(actor, chunk)

    def _take_back(self, actor: str, group_id: str, why: str, ended: Iterable[int], abort: bool = True) -> None:
        """Take ``group_id`` from ``actor`` (a failure, ``RolloutCoordinator.take_back``): with ``abort``
        abort it there (once: its late chunks are not answered with a second ``Abort``); dispatch it
        again, unless it was dropped."""
        if not self.coordinator.take_back(actor, group_id, why, ended):
            return
        if abort:
            self._send(actor, Abort(group_id=group_id), None)
        self.foreign.aborted(actor, group_id)
        group = self.coordinator.groups.get(group_id)
        if group is not None:
            log.warning("group %s taken from generator %s, to resume elsewhere (failure %d of %d allowed): %s",
                        group_id, actor, group.retries.failures, group.retries.limit, why)
            self._dispatch()

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

    def _on_fetch(self, actor: str, version: int, transport: WeightsTransport = "zmq") -> None:
        if transport == "collective" and self.weights.transport == "collective":
            self.weights_groups.fetch(actor, version)  # over its group, or chunks when it has none
        else:
            self._send_chunks(actor, version)
