"""The embedding API: an async client that submits prompt groups to specroll generators, streams
their rollouts back and pushes new policy weights — the rollout coordinator as a library.

Generators connect to the client (its ROUTER binds, each generator's DEALER connects; see the
socket map in docs/architecture.md). The built-in trainer is built on this class; another RL stack uses it the
same way::

    async with RolloutClient(bind="tcp://127.0.0.1:5555") as client:
        await client.wait_for_generators(2)
        group_id = await client.submit(prompt_ids, n=8, sampling=SamplingParams(max_tokens=256))
        try:
            group = await client.next_finished()      # every sample's tokens, logprobs, versions
        except GroupDropped as e:                     # it kept failing: none of it is kept
            await client.submit(e.dropped.prompt_token_ids, n=8, sampling=...)  # or skip it
        await client.publish_weights(model.state_dict(), version=1)

:class:`~specroll.actors.rollout.sync_client.SyncRolloutClient` wraps it for code without an event loop.

How the hub works inside: the package docstring (``actors/rollout/__init__.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from specroll.actors.rollout.drafter_relay import DrafterRelay
from specroll.actors.rollout.drops import DropNotice
from specroll.actors.rollout.foreign_groups import ForeignGroups
from specroll.actors.rollout.hub_socket import HubSocket
from specroll.actors.rollout.liveness import PeerLiveness
from specroll.actors.rollout.outboxes import Mail
from specroll.actors.rollout.peers import HubEvents, Peers
from specroll.actors.rollout.prefix_cache import RESET_TIMEOUT_S, PrefixCacheStats
from specroll.actors.rollout.receive import Receiver
from specroll.actors.rollout.results import GroupResults
from specroll.actors.rollout.ticker import Ticker
from specroll.actors.rollout.timeline import Timeline
from specroll.actors.rollout.weights_groups import BackendChoice, WeightsGroups
from specroll.actors.rollout.weights_publish import PublishedWeights
from specroll.protocol.channel import DEFAULT_WINDOW
from specroll.protocol.curve import RefusalLog, ServerKeys
from specroll.protocol.limits import DEFAULT_MAX_FRAME_BYTES
from specroll.protocol.messages import Abort, RolloutChunk, WeightsTransport
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import DEFAULT_HWM
from specroll.protocol.weights_collective import endpoint_host
from specroll.rl.coordinator import DEFAULT_MAX_QUEUED_GROUPS, LANES, Group, Lane, RolloutCoordinator
from specroll.rl.groups import DEFAULT_MAX_GROUP_RETRIES

__all__ = ["RolloutClient"]

log = logging.getLogger("specroll.client")

_FLUSH_S = 0.5
"""On close, seconds at most to send what is queued (a peer that grants no credit holds its queue)."""


class RolloutClient(GroupResults):
    """Coordinates generators: submit groups, receive rollouts (finished and dropped groups:
    :class:`~specroll.actors.rollout.results.GroupResults`), publish policy weights.

    Args:
        bind: the endpoint generators connect to (``tcp://127.0.0.1:0`` takes a free port; read
            :attr:`endpoint` after start).
        max_groups_in_flight: most training groups dispatched and unfinished at once.
        max_group_retries: times a group is resumed after one of its samples was refused or lost;
            one failure more drops it whole (``specroll/rl/group_retries.py``).
        max_queued_groups: most groups waiting for a generator; :meth:`submit` raises
            :class:`~specroll.rl.coordinator.QueueFull` past it.
        heartbeat_timeout_s: a generator silent this long (while the client kept up reading) is declared dead.
        disconnect_grace_s: a peer whose connection closed and that sends nothing new for this long
            is declared dead (more than a generator's heartbeat interval).
        window: flow-control window (data messages), equal on both ends.
        hwm: ZeroMQ high-water mark of the socket.
        allow_public: permit binding to a non-loopback address (CURVE security, or an explicit
            ``network.allow_insecure``).
        on_chunk: called with ``(actor_id, chunk)`` for every merged chunk (partial rollouts).
        actor_id: this side's id in the handshake.
        timeline: where to record what the client sees (``RUN_DIR/timeline.jsonl``): each generator's
            load at every heartbeat (``generator_load``), policy versions published and acknowledged
            (``policy_published``, ``policy_served``), drafter versions accepted and served
            (``drafter_published``, ``drafter_served``) and every finished group (``group_finished``,
            with its lane); None records nothing. The caller owns it (and closes it).
        vocab_size: the policy's vocabulary size: a chunk with a token id outside ``[0, vocab_size)``
            is refused (logged, answered with ``Error``, nothing of it kept). None checks nothing
            until :attr:`vocab_size` is set (the trainer sets it once its model is loaded).
        weights_transport: ``zmq`` (default): weights travel as ``WeightsChunk`` messages;
            ``collective``: a generator that asks gets a torch.distributed group of its own and
            fetches each version as bucketed broadcasts over it (``weights_groups.py``); chunks
            stay the answer for everyone else (drafter trainers, a generator whose group failed).
        weights_bucket_mb: MiB per broadcast bucket (``collective``).
        weights_backend: ``auto`` (NCCL when this process has CUDA and the generator's engine is
            on CUDA, else gloo), ``gloo`` or ``nccl``.
        weights_host: the address the groups' stores and gloo sockets bind; default: the host of
            ``bind`` (127.0.0.1 for a non-TCP endpoint). Unauthenticated: a cluster-internal address.
        curve: the run's server keys: the socket is a CURVE server that admits only the clients'
            keys, and a message whose key's role is not the role its sender speaks as is refused
            (``protocol/curve.py``); None: no security.
        max_frame_bytes: the socket takes no longer frame from a peer (``MAXMSGSIZE``: the peer is
            disconnected before the frame's body is read); it must hold the largest drafter tensor a
            drafter trainer publishes (``specroll.drafter.eagle_config.max_tensor_bytes`` of the model).
            Message headers are bounded apart (``codec.MAX_HEADER_BYTES``), before decoding.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        max_groups_in_flight: int = 64,
        max_group_retries: int = DEFAULT_MAX_GROUP_RETRIES,
        max_queued_groups: int = DEFAULT_MAX_QUEUED_GROUPS,
        heartbeat_timeout_s: float = 10.0,
        disconnect_grace_s: float = 2.0,
        window: int = DEFAULT_WINDOW,
        hwm: int = DEFAULT_HWM,
        allow_public: bool = False,
        on_chunk: Callable[[str, RolloutChunk], None] | None = None,
        actor_id: str = "trainer",
        timeline: Timeline | None = None,
        vocab_size: int | None = None,
        weights_transport: WeightsTransport = "zmq",
        weights_bucket_mb: int = 64,
        weights_backend: BackendChoice = "auto",
        weights_host: str | None = None,
        curve: ServerKeys | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.refusals = RefusalLog(log)
        """Peers refused by the security layer (each distinct one logged once)."""
        self.coordinator = RolloutCoordinator(max_groups_in_flight, max_group_retries, max_queued_groups)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.actor_id = actor_id
        self.timeline = timeline
        self.mail = Mail(lambda actor: self.peers.registered(actor),
                         lambda actor, what: self.peers.gone(actor, f"a {what} to it could not be routed: its "
                                                                     "connection is gone"))
        self._ticker = Ticker(self.coordinator, self.mail.send, timeline, lambda: self._closing)
        self.drafters = DrafterRelay(self.mail.send, timeline=timeline)
        """Drafter trainers, the current drafter version and acceptance per (drafter, policy) version."""
        self._events = HubEvents()
        self._drops = DropNotice(self._events, timeline)
        self.coordinator.on_drop = self._drops
        self._weights = PublishedWeights(weights_transport, weights_bucket_mb << 20)
        self.weights_groups = WeightsGroups(
            self._weights, weights_host or endpoint_host(bind), weights_backend, heartbeat_timeout_s, self.mail.send,
            self._send_chunks, self._start_soon)
        """The generators' weights groups (``collective``)."""
        self.peers = Peers(self.coordinator, self.drafters, self._weights, self.weights_groups,
                           PeerLiveness(heartbeat_timeout_s, disconnect_grace_s), self._events, self.mail.send,
                           self._ticker.dispatch, actor_id, self.mail.forget)
        """The connected generators and drafter trainers: their load, statistics and liveness."""
        self.dead_generators = self.peers.dead_generators
        """Generators declared dead, one entry per death in order (:attr:`Peers.dead_generators`)."""
        self.generator_stats = self.peers.generator_stats
        """Each generator's last :class:`Stats`."""
        self.drafter_policy_versions = self.peers.drafter_policy_versions
        """Policy version each drafter trainer acknowledged holding."""
        self._receiver = Receiver(self.coordinator, self.peers, self.drafters, self._weights, self.weights_groups,
                                  ForeignGroups(self.coordinator), self._events, self.mail.send, self._send_chunks,
                                  self._ticker.dispatch, curve, self.refusals, timeline, on_chunk, vocab_size)
        self._socket = HubSocket(bind, window=window, hwm=hwm, allow_public=allow_public, curve=curve,
                                 refusals=self.refusals, max_frame_bytes=max_frame_bytes)
        self._tg: TaskGroup | None = None
        self._closing = False

    # ---- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind and start the receive, send and dispatch tasks.

        Raises:
            ValueError: a public bind without ``allow_public``, or a malformed endpoint.
            zmq.ZMQError: the bind failed (e.g. the port is taken).
        """
        channel = self._socket.open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self.mail.open(channel, self._tg)
        self._tg.start_soon(self._receiver.run, channel)
        self._tg.start_soon(self._ticker.run, self.peers)
        self._tg.start_soon(self._socket.watch, self.peers.liveness.disconnected)

    async def aclose(self) -> None:
        """Stop dispatching, send what is queued (for at most ``_FLUSH_S``), stop the tasks, tell every connected
        generator and drafter trainer that the coordinator is gone
        (:meth:`HubSocket.say_dead <specroll.actors.rollout.hub_socket.HubSocket.say_dead>`) and close the socket.

        Shielded from the caller's cancellation (its work is bounded: ``_FLUSH_S`` and ``DEAD_READ_S``), so a client
        cancelled from outside still exits its task group and closes its sockets; the cancellation then goes on."""
        if self._tg is None:
            return
        self._closing = True
        try:
            # Each shielded scope nests inside the task group's (entered in start) or follows it:
            # the group's own scope must be the innermost when it exits.
            with anyio.CancelScope(shield=True):
                await self.mail.flush(_FLUSH_S)
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self._socket.say_dead([*self.coordinator.generators, *self.drafters.drafters], self.actor_id)
                self._socket.close()

    # ---- the API ------------------------------------------------------------------------------

    async def submit(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingParams, payload: object = None,
        lane: Lane = "train", pin: str | None = None,
    ) -> str:
        """Queue a group of ``n`` samples of one prompt (token ids, chat template applied); it is
        dispatched when a generator has room. Returns the group id.

        ``lane="eval"`` (held-out evaluation): dispatched before queued training groups, not counted
        against ``max_groups_in_flight``, finished into its own queue (``pop_finished(lane="eval")``)
        and never forwarded to drafter trainers. ``lane="serve"`` (the HTTP server's requests): the
        same, dispatched after evaluation groups, and not queued when finished — hold the group
        (``coordinator.groups[group_id]``) and follow it through :attr:`on_chunk`. ``pin``: the
        generator to run it on while that one is connected (:attr:`~specroll.rl.coordinator.Group.pin`).

        Raises:
            ValueError: empty prompt, ``n`` < 1 or an unknown lane.
            QueueFull: ``max_queued_groups`` groups wait for a generator already; nothing was queued.
        """
        group_id = self.coordinator.add_group(prompt_token_ids, n, sampling, payload, lane, pin)
        self._ticker.dispatch()
        return group_id

    @property
    def generator_versions(self) -> dict[str, int]:
        """The policy version each connected generator serves (its newest heartbeat or
        acknowledgement), by actor id; one record per generator, kept by the coordinator."""
        return self.coordinator.served_versions()

    def generators_idle(self) -> bool:
        """No group (training, evaluation or a served request) is queued or generating: every generator's live batch is
        empty, so its cores are free. Safe to call from a worker thread (a racy but harmless read)."""
        c = self.coordinator
        return not any(c.num_queued(lane) or c.num_in_flight(lane) for lane in LANES)

    async def abort(self, group_id: str) -> None:
        """Drop a group; its generator stops it. Chunks arriving later are ignored.

        Raises:
            KeyError: no such group queued or in flight.
        """
        actor = self.coordinator.abort(group_id)
        if actor is not None:
            self.mail.send(actor, Abort(group_id=group_id))
            self._receiver.foreign.aborted(actor, group_id)  # its chunks still in flight: no second Abort

    async def wait_for_generators(self, count: int, timeout: float | None = None) -> None:
        """Wait until ``count`` generators are ready: handshake done and capacity reported (their
        first heartbeat), so groups submitted next spread over all of them.

        Raises:
            TimeoutError: fewer were ready within ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            while sum(a in self.peers.capacity_known for a in self.coordinator.generators) < count:
                await self._events.generators.wait()

    async def publish_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
        dtype: str = "bfloat16",
    ) -> None:
        """Make ``version`` the policy generators should serve; each fetches it between its steps
        (without draining) and acknowledges (:attr:`generator_versions`).

        The tensors are snapshotted (cast to ``dtype``, on the CPU) before this returns, so
        training may go on changing the originals.

        Args:
            named_tensors: Hugging Face parameter names → tensors.
            version: a policy version above every earlier one.
            dtype: ``bfloat16`` (half the bytes) or ``float32`` on the wire.

        Raises:
            ValueError: an unknown dtype or a version not above the last published one.
        """
        named = dict(named_tensors)
        # Off the event loop: the snapshot (and for ``collective`` the checksums) take ~0.1 s per 100M parameters.
        announce = await anyio.to_thread.run_sync(self._weights.publish, named, version, dtype)
        if self.timeline is not None:
            self.timeline.record("policy_published", version=version)
        for actor in [*self.coordinator.generators, *self.drafters.drafters]:
            self.mail.send(actor, announce)

    @property
    def weights_transport(self) -> WeightsTransport:
        """How the next published version is offered: ``zmq`` (chunks only) or ``collective`` (also
        over weights groups). May be changed between publishes (``benchmarks/bench_weight_sync.py``
        compares both on one set of generators); groups already built stay."""
        return self._weights.transport

    @weights_transport.setter
    def weights_transport(self, transport: WeightsTransport) -> None:
        if transport not in ("zmq", "collective"):
            raise ValueError(f"weights_transport={transport!r}, expected 'zmq' or 'collective'")
        self._weights.transport = transport

    def pause_drafter(self, paused: bool = True) -> None:
        """Ask drafter trainers to stop training between their steps (``False``: go on); they hear it
        within about half a second (:class:`~specroll.protocol.messages.Capacity`)."""
        self.drafters.paused = paused

    async def wait_for_version(self, version: int, count: int | None = None, timeout: float | None = None) -> None:
        """Wait until ``count`` generators (default: all connected) acknowledged ``version`` or later.

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            while True:
                served, live = self.generator_versions, list(self.coordinator.generators)
                if sum(served.get(a, -1) >= version for a in live) >= (len(live) if count is None else count):
                    return
                await self._events.version.wait()  # an acknowledgement, a heartbeat or a generator gone

    def prefix_cache_stats(self) -> dict[str, PrefixCacheStats]:
        """Each connected generator's :class:`PrefixCacheStats` (tokens, ``hit_rate``) as of its last ``Stats``."""
        return self.peers.prefix_caches.stats()

    async def reset_prefix_cache(self, timeout: float = RESET_TIMEOUT_S) -> int:
        """Make every connected generator forget its prefix cache: how many did in ``timeout`` s (``PrefixCaches``)."""
        return await self.peers.prefix_caches.reset(timeout)

    @property
    def endpoint(self) -> str:
        """The bound endpoint, e.g. ``tcp://127.0.0.1:41234`` ('' before :meth:`start`)."""
        return self._socket.endpoint

    # ---- what the peers and the receiver hold ----------------------------------------------------

    @property
    def on_chunk(self) -> Callable[[str, RolloutChunk], None] | None:
        """Called with ``(actor_id, chunk)`` for every merged chunk (partial rollouts)."""
        return self._receiver.on_chunk

    @on_chunk.setter
    def on_chunk(self, callback: Callable[[str, RolloutChunk], None] | None) -> None:
        self._receiver.on_chunk = callback

    @property
    def on_drop(self) -> Callable[[Group], None] | None:
        """Called with every group the retry rule drops, any lane (its ``dropped`` set), after it left."""
        return self._drops.on_drop

    @on_drop.setter
    def on_drop(self, callback: Callable[[Group], None] | None) -> None:
        self._drops.on_drop = callback

    @property
    def vocab_size(self) -> int | None:
        """Token ids a chunk may carry are in ``[0, vocab_size)``; None: not checked. Set it before
        the first :meth:`submit` (no chunk is merged before then: chunks of groups this client never
        issued are refused or aborted)."""
        return self._receiver.vocab_size

    @vocab_size.setter
    def vocab_size(self, vocab_size: int | None) -> None:
        self._receiver.vocab_size = vocab_size

    @property
    def protocol_errors(self) -> int:
        """Messages refused: malformed, out of sequence, from a peer without a handshake, or chunks
        that cannot be merged (each logged, and answered with ``Error`` where credit allows)."""
        return self._receiver.protocol_errors

    # ---- tasks --------------------------------------------------------------------------------

    def _send_chunks(self, actor: str, version: int) -> None:
        """Answer a fetch of ``version`` with its chunks (or the ``Error`` naming the current version)."""
        for msg, tensors in self._weights.answer_fetch(version):
            self.mail.send(actor, msg, tensors)

    def _start_soon(self, fn: Callable[..., Any], *args: object) -> None:
        """Start ``fn(*args)`` in the client's task group (nothing once closed)."""
        if self._tg is not None and not self._closing:
            self._tg.start_soon(fn, *args)
