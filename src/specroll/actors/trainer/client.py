"""The embedding API: an async client that submits prompt groups to specroll generators, streams
their rollouts back and pushes new policy weights — the rollout coordinator as a library.

Generators connect to the client (its ROUTER binds, each generator's DEALER connects; see the
README's socket map). The built-in trainer is built on this class; another RL stack uses it the
same way::

    async with RolloutClient(bind="tcp://127.0.0.1:5555") as client:
        await client.wait_for_generators(2)
        group_id = await client.submit(prompt_ids, n=8, sampling=SamplingParams(max_tokens=256))
        group = await client.next_finished()          # every sample's tokens, logprobs, versions
        await client.publish_weights(model.state_dict(), version=1)

:class:`~specroll.actors.trainer.sync_client.SyncRolloutClient` wraps it for code without an event loop.

Weights travel as ZeroMQ chunks on the same socket (the default), or with
``weights_transport="collective"`` as bucketed broadcasts over one torch.distributed group per
generator (``weights_groups.py``; announcements and acknowledgements stay on ZeroMQ).

Drafter trainers connect to the same endpoint (``Hello(role="drafter")``); the client feeds them
finished rollouts and the generators' load, and relays their drafter versions to the generators
(:class:`~specroll.actors.trainer.drafter_relay.DrafterRelay`, :attr:`RolloutClient.drafters`).

Inside, three tasks share one :class:`~specroll.protocol.channel.Channel`: a receive loop (which
never waits on a send: replies go through an outgoing queue, so credit grants are always read;
``client_receive.py``), a sender per peer, and a ticker that dispatches queued groups by free
capacity and declares peers gone (their groups resume elsewhere from their streamed tokens) when
their connection closes, or after ``heartbeat_timeout_s`` of silence while the client kept up with
its socket (``peer_liveness.py``; a monitor task watches the socket's connections).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anyio
import torch
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup
from zmq.utils.monitor import parse_monitor_message

from specroll.actors.peer.weights_collective import endpoint_host
from specroll.actors.trainer.client_receive import ClientReceive
from specroll.actors.trainer.drafter_relay import DrafterRelay
from specroll.actors.trainer.foreign_groups import ForeignGroups
from specroll.actors.trainer.peer_liveness import PeerLiveness
from specroll.actors.trainer.peer_outboxes import Outboxes
from specroll.actors.trainer.timeline import Timeline
from specroll.actors.trainer.weights_groups import BackendChoice, WeightsGroups
from specroll.actors.trainer.weights_publish import PublishedWeights
from specroll.actors.wakeup import Wakeup
from specroll.protocol.channel import DEFAULT_WINDOW, Channel
from specroll.protocol.codec import ProtocolError
from specroll.protocol.curve import RefusalLog, RunAuthenticator, ServerKeys
from specroll.protocol.limits import DEFAULT_MAX_FRAME_BYTES
from specroll.protocol.messages import (
    Abort,
    Dead,
    Hello,
    RolloutChunk,
    Stats,
    ToTrainer,
    WeightsTransport,
)
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import DEFAULT_HWM, close_socket, last_endpoint, make_socket
from specroll.rl.coordinator import Group, Lane, RolloutCoordinator

__all__ = ["RolloutClient"]

log = logging.getLogger("specroll.client")

_FLUSH_S = 0.5
_MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""What the trainer's socket monitor reports: closed connections, failed security handshakes."""
"""On close, seconds at most to send what is queued (a peer that grants no credit holds its queue)."""
_DEAD_READ_S = 2.0
"""On close, seconds at most to wait until every peer read ``Dead`` (it answers ``Hello``)."""
_DEAD_LINGER_MS = 1000
"""On close, milliseconds ZeroMQ may take to deliver what is still queued to peers still connected."""


class RolloutClient(ClientReceive):
    """Coordinates generators: submit groups, receive rollouts, publish policy weights.

    Args:
        bind: the endpoint generators connect to (``tcp://127.0.0.1:0`` takes a free port; read
            :attr:`endpoint` after start).
        max_groups_in_flight: most groups dispatched and unfinished at once.
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
            drafter trainer publishes (``specroll.drafter.eagle_head.max_tensor_bytes`` of the model).
            Message headers are bounded apart (``codec.MAX_HEADER_BYTES``), before decoding.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        max_groups_in_flight: int = 64,
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
        self.bind = bind
        self.max_frame_bytes = max_frame_bytes
        self.curve = curve
        self.refusals = RefusalLog(log)
        """Peers refused by the security layer (each distinct one logged once)."""
        self._auth: RunAuthenticator | None = None
        self.coordinator = RolloutCoordinator(max_groups_in_flight)
        self._foreign = ForeignGroups(self.coordinator)  # group ids unique across incarnations
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.window, self.hwm, self.allow_public = window, hwm, allow_public
        self.on_chunk = on_chunk
        self.actor_id = actor_id
        self.timeline = timeline
        self.vocab_size = vocab_size
        """Token ids a chunk may carry are in ``[0, vocab_size)``; None: not checked. Set it before
        the first :meth:`submit` (no chunk is merged before then: chunks of groups this client never
        issued are refused or aborted)."""
        self.endpoint = ""
        """The bound endpoint, e.g. ``tcp://127.0.0.1:41234`` (set by :meth:`start`)."""
        self.generator_stats: dict[str, Stats] = {}
        """Each generator's last :class:`Stats`."""
        self.dead_generators: list[str] = []
        """Generators declared dead (by ``Dead`` or heartbeat timeout), in order."""
        self.protocol_errors = 0
        """Messages refused: malformed, out of sequence, from a peer without a handshake, or chunks
        that cannot be merged (each logged, and answered with ``Error`` where credit allows)."""
        self.drafters = DrafterRelay(self._queue, timeline=timeline)
        """Drafter trainers, the current drafter version and acceptance per (drafter, policy) version."""
        self.drafter_policy_versions: dict[str, int] = {}
        """Policy version each drafter trainer acknowledged holding."""
        self._load: dict[str, tuple[int, int]] = {}
        """Each generator's live batch and its capacity in sequences (last heartbeat)."""
        self._liveness = PeerLiveness(heartbeat_timeout_s, disconnect_grace_s)
        self._capacity_known: set[str] = set()
        self._finished_event = Wakeup()
        self._version_event = Wakeup()
        self._generators_event = Wakeup()
        self._weights = PublishedWeights(weights_transport, weights_bucket_mb << 20)
        self.weights_groups = WeightsGroups(
            self._weights, weights_host or endpoint_host(bind), weights_backend, heartbeat_timeout_s, self._queue,
            self._send_chunks, self._start_soon)
        """The generators' weights groups (``collective``)."""
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._channel: Channel[Any] | None = None
        self._tg: TaskGroup | None = None
        self._outboxes: Outboxes | None = None
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
        self._ctx = zmq.asyncio.Context()
        try:
            if self.curve is not None:  # the ZAP handler runs before anything can connect
                self._auth = RunAuthenticator(self._ctx, self.curve, self.refusals)
                self._auth.start()
            self._socket = make_socket(self._ctx, zmq.ROUTER, bind=self.bind, hwm=self.hwm,
                                       allow_public=self.allow_public, curve=self.curve,
                                       monitor_events=_MONITOR_EVENTS, max_frame_bytes=self.max_frame_bytes)
        except BaseException:
            self._stop_auth()
            self._ctx.term()
            raise
        self._monitor = self._socket.get_monitor_socket()  # attached before the bind
        self.endpoint = last_endpoint(self._socket)
        self._channel = Channel(self._socket, ToTrainer, window=self.window)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._outboxes = Outboxes(self._channel, self._tg)
        self._tg.start_soon(self._receive_loop)
        self._tg.start_soon(self._tick_loop)
        self._tg.start_soon(self._watch_connections)

    async def aclose(self) -> None:
        """Stop dispatching, send what is queued (for at most ``_FLUSH_S``), stop the tasks, tell every
        connected generator and drafter trainer that the coordinator is gone (:meth:`_say_dead`) and
        close the socket.

        Shielded from the caller's cancellation (its work is bounded: ``_FLUSH_S`` and
        ``_DEAD_READ_S``), so a client cancelled from outside still exits its task group and closes
        its sockets; the cancellation then goes on."""
        if self._tg is None:
            return
        self._closing = True
        try:
            # Each shielded scope nests inside the task group's (entered in start) or follows it:
            # the group's own scope must be the innermost when it exits.
            with anyio.CancelScope(shield=True):
                if self._outboxes is not None:
                    with anyio.move_on_after(_FLUSH_S):
                        await self._outboxes.flushed()
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self._say_dead([*self.coordinator.generators, *self.drafters.drafters])
                if self._monitor is not None:
                    self._monitor.close(linger=0)
                if self._socket is not None:
                    close_socket(self._socket, linger_ms=_DEAD_LINGER_MS)
                if (summary := self.refusals.summary()) is not None:
                    log.info("%s", summary)
                self._stop_auth()
                if self._ctx is not None:
                    self._ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    async def _say_dead(self, peers: list[str]) -> None:
        """Send each peer ``Dead``, the last message it gets from this client (a generator started alone
        then exits 0), and keep the connection open until it read it: a peer's socket drops what it
        received but had not read when the connection closes (``IMMEDIATE``), so closing at once loses
        the notice. A peer that read ``Dead`` answers ``Hello`` (it registers again with whichever
        trainer comes next); one that does not answer within ``_DEAD_READ_S`` (gone, or not reading)
        is left. ``Dead`` is a control message: it needs no credit and is handed to the socket at once."""
        assert self._channel is not None
        dead = Dead(actor_id=self.actor_id, reason="client closed")
        unread = set()
        for actor in peers:
            if await self._channel.send_control_now(dead, peer=actor.encode()):
                unread.add(actor.encode())
            else:
                log.info("%s is gone or does not read: no Dead for it", actor)
        log.info("Dead sent to %d peers; waiting until they read it", len(unread))
        with anyio.move_on_after(_DEAD_READ_S):
            while unread:
                try:
                    received = await self._channel.recv()
                except ProtocolError:
                    continue
                if isinstance(received.msg, Hello):
                    unread.discard(received.peer or b"")
        if unread:
            log.info("no answer to Dead from %s within %.0f s", sorted(p.decode(errors="replace") for p in unread),
                     _DEAD_READ_S)

    # ---- the API ------------------------------------------------------------------------------

    async def submit(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingParams, payload: object = None,
        lane: Lane = "train",
    ) -> str:
        """Queue a group of ``n`` samples of one prompt (token ids, chat template applied); it is
        dispatched when a generator has room. Returns the group id.

        ``lane="eval"`` (held-out evaluation): dispatched before queued training groups, not counted
        against ``max_groups_in_flight``, finished into its own queue (``pop_finished(lane="eval")``)
        and never forwarded to drafter trainers.

        Raises:
            ValueError: empty prompt, ``n`` < 1 or an unknown lane.
        """
        group_id = self.coordinator.add_group(prompt_token_ids, n, sampling, payload, lane)
        self._dispatch()
        return group_id

    async def next_finished(self, timeout: float | None = None) -> Group:
        """The oldest finished group, waiting for one if none is ready.

        Raises:
            TimeoutError: none finished within ``timeout`` seconds.
        """
        await self.wait_finished(1, timeout)
        return self.coordinator.pop_finished(1)[0]

    async def wait_finished(self, count: int, timeout: float | None = None, lane: Lane = "train") -> None:
        """Wait until at least ``count`` finished groups of ``lane`` are ready (none is taken).

        Raises:
            TimeoutError: fewer finished within ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            while self.coordinator.num_finished(lane) < count:
                await self._finished_event.wait()

    def pop_finished(self, limit: int | None = None, lane: Lane = "train") -> list[Group]:
        """Finished groups of ``lane`` ready now, oldest first, without waiting."""
        return self.coordinator.pop_finished(limit, lane)

    @property
    def num_finished(self) -> int:
        """Finished training groups not yet popped."""
        return self.coordinator.num_finished()

    @property
    def generator_versions(self) -> dict[str, int]:
        """The policy version each connected generator serves (its newest heartbeat or
        acknowledgement), by actor id; one record per generator, kept by the coordinator."""
        return self.coordinator.served_versions()

    def generators_idle(self) -> bool:
        """No group (training or evaluation) is queued or generating: every generator's live batch is
        empty, so its cores are free. Safe to call from a worker thread (a racy but harmless read)."""
        c = self.coordinator
        return not any(c.num_queued(lane) or c.num_in_flight(lane) for lane in ("train", "eval"))

    @property
    def num_pending(self) -> int:
        """Training groups queued or in flight."""
        return self.coordinator.num_pending()

    async def abort(self, group_id: str) -> None:
        """Drop a group; its generator stops it. Chunks arriving later are ignored.

        Raises:
            KeyError: no such group queued or in flight.
        """
        actor = self.coordinator.abort(group_id)
        if actor is not None:
            self._queue(actor, Abort(group_id=group_id))

    async def wait_for_generators(self, count: int, timeout: float | None = None) -> None:
        """Wait until ``count`` generators are ready: handshake done and capacity reported (their
        first heartbeat), so groups submitted next spread over all of them.

        Raises:
            TimeoutError: fewer were ready within ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            while sum(a in self._capacity_known for a in self.coordinator.generators) < count:
                await self._generators_event.wait()

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
            self._queue(actor, announce)

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
                live = [a for a in self.coordinator.generators]
                need = len(live) if count is None else count
                served = self.generator_versions
                if sum(served.get(a, -1) >= version for a in live) >= need:
                    return
                await self._version_event.wait()  # an acknowledgement, a heartbeat or a generator gone

    # ---- tasks --------------------------------------------------------------------------------

    def _queue(self, actor: str, msg: Any, tensors: list[torch.Tensor] | None = None) -> None:
        """Send to a generator or drafter trainer through its own outbox, in order; to any other peer,
        a best-effort reply (:class:`~specroll.actors.trainer.peer_outboxes.Outboxes`)."""
        if self._outboxes is None:
            log.debug("not started: %s to %s dropped", type(msg).__name__, actor)
            return
        if actor not in self.coordinator.generators and actor not in self.drafters.drafters:
            self._outboxes.reply(actor, msg)
            return
        self._outboxes.put(actor, msg, tensors)

    def _start_soon(self, fn: Callable[..., Any], *args: object) -> None:
        """Start ``fn(*args)`` in the client's task group (nothing once closed)."""
        if self._tg is not None and not self._closing:
            self._tg.start_soon(fn, *args)

    async def _tick_loop(self) -> None:
        last_capacity = 0.0
        while True:
            now = time.monotonic()
            if now - last_capacity >= 0.5:
                last_capacity = now
                loads = [self._load[a] for a in self.coordinator.generators if a in self._load]
                self.drafters.tick(sum(live for live, _ in loads), sum(cap for _, cap in loads))
            for actor, why in self._liveness.expired(now):
                self._generator_gone(actor, why)
            self._dispatch()
            await anyio.sleep(0.05)

    async def _watch_connections(self) -> None:
        """Tell the liveness which connections closed (the socket monitor's ``EVENT_DISCONNECTED``),
        and log each kind of failed security handshake once (the authenticator logs refused keys)."""
        assert self._socket is not None
        monitor = self._monitor
        assert monitor is not None
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._liveness.disconnected(int(event["value"]), time.monotonic())
                else:
                    self.refusals.handshake_failed(event["event"], int(event["value"]), self.curve is not None)
        finally:
            self._socket.disable_monitor()
            monitor.close(linger=0)

    def _dispatch(self) -> None:
        if self._closing:
            return  # nothing new for generators about to get Dead
        for actor, msg in self.coordinator.dispatch():
            if msg.resume and self.timeline is not None:
                self.timeline.record("group_resumed", group_id=msg.group_id, actor=actor,
                                     held={r.index: r.token_ids for r in msg.resume})
            self._queue(actor, msg)

