"""The peers connected to the hub — generators and drafter trainers: who registered, what each
reported (load, statistics, the policy it holds), whether it is alive, and forgetting one that is
gone (a generator's groups then resume elsewhere from the tokens already streamed).

Messages go out through the hub's ``send`` (its per-peer outboxes); the hub's wake-ups tell its
waiters what changed (:class:`HubEvents`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specroll.actors.rollout.drafter_relay import DrafterRelay
from specroll.actors.rollout.liveness import PeerLiveness
from specroll.actors.rollout.outboxes import Send
from specroll.actors.rollout.prefix_cache import PrefixCaches
from specroll.actors.rollout.weights_groups import WeightsGroups
from specroll.actors.rollout.weights_publish import PublishedWeights
from specroll.actors.shared.wakeup import Wakeup
from specroll.protocol.messages import PROTOCOL_VERSION, Error, Hello, Refuse, Stats, Welcome
from specroll.rl.coordinator import RolloutCoordinator

log = logging.getLogger("specroll.client")


@dataclass
class HubEvents:
    """What the hub's waiters wait for (each a level-triggered :class:`~specroll.actors.shared.wakeup.Wakeup`)."""

    finished: Wakeup = field(default_factory=Wakeup)
    """A group finished."""
    version: Wakeup = field(default_factory=Wakeup)
    """A generator acknowledged or reported a policy version, or one is gone (one fewer to wait for)."""
    generators: Wakeup = field(default_factory=Wakeup)
    """A generator reported its capacity for the first time."""


class Peers:
    """The hub's generators and drafter trainers (module docstring).

    Args:
        coordinator: the hub's groups and generators.
        drafters: the drafter trainers and drafter versions.
        weights: the published policy versions (a joining peer is told the latest).
        weights_groups: the generators' collective weights groups (a gone generator leaves its own).
        liveness: the rules by which a silent or disconnected peer is gone.
        events: woken when a generator is gone.
        send: queues a message for a peer.
        dispatch: hands queued groups to generators with room (after one is gone, its groups are queued).
        actor_id: the hub's own id in ``Welcome``.
        forget_transport: drops the outbox and channel state of a peer that is gone.
    """

    def __init__(self, coordinator: RolloutCoordinator, drafters: DrafterRelay, weights: PublishedWeights,
                 weights_groups: WeightsGroups, liveness: PeerLiveness, events: HubEvents, send: Send,
                 dispatch: Callable[[], None], actor_id: str, forget_transport: Callable[[str], None]) -> None:
        self.coordinator, self.drafters, self.weights = coordinator, drafters, weights
        self.weights_groups, self.liveness, self.events = weights_groups, liveness, events
        self._send, self._dispatch, self.actor_id = send, dispatch, actor_id
        self._forget_transport = forget_transport
        self.generator_stats: dict[str, Stats] = {}
        """Each generator's last :class:`Stats`."""
        self.prefix_caches = PrefixCaches(self.generator_stats, lambda: self.coordinator.generators, send)
        """The generators' prefix-cache counters and resets."""
        self.dead_generators: list[str] = []
        """Generators declared dead (by ``Dead``, a closed connection or silence), one entry per death
        in order: a history, not the dead set (one that comes back registers again and may appear
        twice; :attr:`coordinator` ``.generators`` holds those registered now)."""
        self.drafter_policy_versions: dict[str, int] = {}
        """Policy version each drafter trainer acknowledged holding."""
        self.load: dict[str, tuple[int, int]] = {}
        """Each generator's live batch and its capacity in sequences (last heartbeat)."""
        self.capacity_known: set[str] = set()
        """Generators that reported their capacity (a heartbeat) since they said ``Hello``."""

    def registered(self, actor: str) -> bool:
        """``actor`` is a generator or drafter trainer that said ``Hello``."""
        return actor in self.coordinator.generators or actor in self.drafters.drafters

    def on_hello(self, actor: str, msg: Hello, fd: int | None) -> None:
        """Register ``actor`` (a restart under a known id first forgets the old one) and welcome it
        with the latest policy and drafter versions; a version or role mismatch gets ``Refuse``."""
        if msg.protocol_version != PROTOCOL_VERSION:
            self._send(actor, Refuse(reason=f"protocol version {msg.protocol_version}, this trainer speaks "
                                            f"{PROTOCOL_VERSION}; run the same specroll version on both"), None)
            return
        if msg.role not in ("generator", "drafter"):
            self._send(actor, Refuse(reason=f"role {msg.role!r}: this endpoint serves 'generator' and 'drafter'"),
                       None)
            return
        if msg.role == "drafter":
            if actor in self.drafters.drafters:
                self.gone(actor, "it said Hello again")
            self.drafters.add_drafter(actor)
        else:
            if actor in self.coordinator.generators:  # it restarted under the same id: its groups are gone
                self.gone(actor, "it said Hello again")
            self.coordinator.add_generator(actor)
        self.liveness.add(actor, time.monotonic(), fd)
        self._send(actor, Welcome(protocol_version=PROTOCOL_VERSION, actor_id=self.actor_id), None)
        if self.weights.announcement is not None:
            self._send(actor, self.weights.announcement, None)
        self.drafters.on_generator_hello(actor)  # a restarted drafter trainer numbers above it

    def on_heartbeat(self, actor: str, batch_size: int, free_seqs: int) -> None:
        """A generator's load; its first one makes it ready for :meth:`RolloutClient.wait_for_generators`."""
        self.load[actor] = (batch_size, batch_size + free_seqs)
        if actor not in self.capacity_known:
            self.capacity_known.add(actor)
            self.events.generators.notify()

    def gone(self, actor: str, why: str) -> None:
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
        self.load.pop(actor, None)
        resumed = self.coordinator.remove_generator(actor, why)  # a failure of each of its groups: some dropped
        self.capacity_known.discard(actor)
        self.dead_generators.append(actor)
        self.weights_groups.forget(actor)
        self.prefix_caches.gone(actor)
        self._forget(actor)
        self.events.version.notify()  # one fewer generator to wait for
        log.warning("generator %s is gone (%s); %d groups resume elsewhere", actor, why, len(resumed))
        self._dispatch()

    def lost_messages(self, peer: bytes | None, expected: int, seq: int) -> bool:
        """A registered peer's messages ``expected .. seq-1`` never arrived (its connection dropped
        and came back: a trainer paused past the ZeroMQ heartbeat, a network partition, a frame over
        the socket's cap). What the lost chunks carried would leave its groups with a gap no later
        chunk can fill, so the peer is treated as gone — its groups resume elsewhere from the tokens
        held — and told ``unknown_peer``, on which it registers again with ``Hello``. Returns whether
        the message that revealed the gap is to be dropped (it came from such a peer)."""
        actor = (peer or b"").decode(errors="replace")
        if not self.registered(actor):
            return False
        self.gone(actor, f"its messages {expected}..{seq - 1} never arrived")
        self._send(actor, Error(code="unknown_peer", message=f"your messages {expected}..{seq - 1} never "
                                "arrived; send Hello to register again"), None)
        return True

    def tell_drafters_the_load(self) -> None:
        """Send every drafter trainer the generators' live batch and capacity (their last heartbeats)."""
        loads = [self.load[a] for a in self.coordinator.generators if a in self.load]
        self.drafters.tick(sum(live for live, _ in loads), sum(cap for _, cap in loads))

    def expire(self, now: float) -> None:
        """Declare gone every peer the liveness rules give up on at ``now``."""
        for actor, why in self.liveness.expired(now):
            self.gone(actor, why)

    def _forget(self, actor: str) -> None:
        """Drop a gone peer's liveness, outbox and channel state."""
        self.liveness.remove(actor)
        self._forget_transport(actor)
