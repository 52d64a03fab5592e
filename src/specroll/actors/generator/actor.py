"""The generator actor: one :class:`~specroll.engine.engine.Engine` behind a DEALER socket.

The connection to the trainer — handshake, send and receive tasks, heartbeats, the trainer's
liveness, signals, the exit report — is the shared peer lifecycle
(:class:`~specroll.actors.peer.lifecycle.PeerConnection`); this module is the generator's role in it:

* **receive** (:meth:`GeneratorActor.on_message`) — queues engine work (``SubmitGroup``, ``Abort``,
  ``ResetPrefixCache``, a complete weight version, a checked drafter) for the step loop, assembles ``WeightsChunk``s;
* **step loop** (:meth:`GeneratorActor.serve`) — the only code that touches the engine: applies
  queued work between steps, runs ``Engine.step`` in a worker thread, turns its deltas into
  ``RolloutChunk``s; it waits once the outbox holds ``max_outbox`` messages, so a slow trainer
  delays decoding only then (bounded memory);
* **tick** — ``Heartbeat`` every ``heartbeat_s`` (free capacity) and ``Stats`` every ``stats_s``;
* **signals** — the first SIGTERM/SIGINT finishes the current step, flushes chunks, sends ``Dead``
  and exits 0; a second stops at once.

Message flow with the trainer: ``Hello`` → ``Welcome`` | ``Refuse``; ``SubmitGroup`` → chunks of
each sample (the last ``finished``); ``Abort`` → final chunks with ``"abort"``; ``ResetPrefixCache`` →
the prefix cache forgotten between two steps → ``AckResetPrefixCache``;
``WeightsAvailable`` → ``FetchWeights`` → ``WeightsChunk``s → applied between steps → ``AckWeights``;
with ``network.weights_transport = "collective"`` the tensors come over the generator's own
torch.distributed group instead, once it has joined one (``JoinWeightsGroup`` → ``WeightsGroup``;
``FetchWeights(transport="collective")`` → ``WeightsBroadcast`` → bucketed broadcasts, each bucket's
checksum checked; ``weights_group.py``), and as chunks until then or after the group failed. Which
version to fetch and its transfer: ``policy_updates.py``; drafter versions: ``drafter_updates.py``.

Policy-version attribution: an update is applied only between steps, so every engine step runs under
exactly one version and each token it emits is tagged with that version — the weights whose forward
pass produced the token's logits. With ``kv_policy="keep"`` that forward pass attends to K/V of
earlier positions computed under older weights (the last emitted token's K/V is computed in the
first step after the update, under the new weights); with ``"recompute"`` every live request is
re-prefilled under the new weights first. Tokens emitted before the update keep their old version;
``AckWeights(v)`` is queued after the update, so every token of a chunk sent after the ack that was
emitted after the update carries ``v``.

Run as ``python -m specroll.actors.generator --connect tcp://127.0.0.1:PORT --model PATH``, or with a run
config: ``... --connect tcp://127.0.0.1:PORT --config RUN_DIR/config.toml [--set a.b=v]`` (``specroll generator``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import assert_never

import anyio

from specroll.actors.config import RunConfig
from specroll.actors.generator.drafter_swap import DrafterSlot, ReadyDrafter
from specroll.actors.generator.drafter_updates import DrafterUpdates
from specroll.actors.generator.engine_build import build_engine
from specroll.actors.generator.live_samples import LiveSamples, SampleRefused
from specroll.actors.generator.policy_updates import PolicyUpdates, ReadyWeights
from specroll.actors.generator.rollout_stream import DraftCounter
from specroll.actors.generator.submit_limits import SubmitLimits
from specroll.actors.peer.lifecycle import PeerConnection
from specroll.actors.peer.trainer_channel import trainer_channel
from specroll.actors.shared.security import peer_keys
from specroll.actors.telemetry.endpoint import serving_metrics
from specroll.actors.telemetry.generator_metrics import RequestLatency, SyncCounters, collect_generator
from specroll.drafter.eagle_config import max_tensor_bytes
from specroll.engine.engine import Engine
from specroll.protocol.channel import Channel, Received
from specroll.protocol.limits import LimitExceeded
from specroll.protocol.messages import (
    Abort,
    AckResetPrefixCache,
    AckWeights,
    Credit,
    Dead,
    DrafterAvailable,
    DrafterWeights,
    Error,
    Heartbeat,
    Refuse,
    ResetPrefixCache,
    SpecStats,
    Stats,
    SubmitGroup,
    ToGenerator,
    WeightsAvailable,
    WeightsBroadcast,
    WeightsChunk,
    WeightsGroup,
    Welcome,
)
from specroll.protocol.weights_collective import endpoint_host

log = logging.getLogger("specroll.generator")


class GeneratorActor:
    """Serves one engine to one trainer over ``channel`` (see the module docstring); the generator's
    role in the shared peer lifecycle (:class:`~specroll.actors.peer.lifecycle.PeerConnection`).

    Args:
        config: the run config; the actor reads ``[generator]`` (streaming, heartbeats, KV policy,
            speculation, ``stats_s``, ``linger_s``, ``max_outbox``), ``generator.engine.max_num_seqs``
            (the capacity it announces), ``[network]`` (``heartbeat_timeout_s``: the trainer's) and
            ``drafter.kv_cache_gb``.
        engine: a ready engine (built from ``config.generator.engine``); only this actor's step loop touches it.
        channel: a DEALER channel connected to the trainer, inbound union ``ToGenerator``.
        draft_counter: the engine's proposer when speculating (for per-chunk ``SpecStats``).
        connect: the trainer's endpoint (log lines).
        actor_id: this process's id (``Hello``, ``Dead``).
    """

    def __init__(
        self, config: RunConfig, engine: Engine, channel: Channel[ToGenerator],
        draft_counter: DraftCounter | None = None, *, connect: str, actor_id: str,
    ) -> None:
        self.config = config
        self.gen = config.generator
        self.engine = engine
        self.speculative = config.speculative()
        """``generator.speculative`` with ``auto`` resolved."""
        self.peer: PeerConnection[ToGenerator] = PeerConnection(
            channel, role="generator", name="generator", actor_id=actor_id, endpoint=connect,
            heartbeat_s=self.gen.heartbeat_s, trainer_timeout_s=config.network.heartbeat_timeout_s,
            reconnect_timeout_s=config.network.reconnect_s(),
            linger_s=self.gen.linger_s, log=log, graceful_signals=True,
            capabilities=("resume", "bf16-weights", *(("speculative",) if self.speculative != "off" else ())))
        self.drafter = DrafterSlot(engine, draft_counter, config.drafter.kv_cache_gb, self.gen.engine.seed)
        """The learned drafter served (``speculative="eagle"``) and its version."""
        self.drafter_updates = DrafterUpdates(engine, self.drafter, self.peer.put, self._queue,
                                              enabled=self.speculative == "eagle")
        """The drafter versions announced, fetched and checked."""
        self.samples = LiveSamples(engine, self.drafter, self.peer.put, self.gen.stream_every_steps,
                                   self.speculative != "off", RequestLatency() if config.metrics.enabled else None)
        self.sync = SyncCounters()
        """Policy versions applied, their bytes and seconds, and the pauses to apply them."""
        self._inbox: deque[SubmitGroup | Abort | ResetPrefixCache | ReadyWeights | ReadyDrafter] = deque()
        """Engine work for the step loop, in arrival order."""
        self.limits = SubmitLimits.of(engine, self.gen.engine.max_num_seqs)
        """What a ``SubmitGroup`` may ask of this engine (checked before it is queued)."""
        self.policy_updates = PolicyUpdates(engine, self.peer.put, self._queue,
                                            collective=config.network.weights_transport == "collective",
                                            trainer_host=endpoint_host(connect))
        """The policy versions announced and fetched (over chunks or this generator's weights group)."""
        self._largest_group = 1
        self._last_stats = time.monotonic()
        self.num_steps = 0
        """Engine steps run."""
        self.busy_s = self.idle_s = 0.0
        """Seconds in engine steps, and with nothing to decode."""

    async def run(self) -> int:
        """Serve until a signal, a refusal or the trainer's loss; send ``Dead``; return the exit code
        (0 after SIGTERM/SIGINT, 2 refused, 3 trainer unreachable, 1 an internal failure)."""
        return await self.peer.run(self)

    def stop(self, code: int, reason: str, *, graceful: bool) -> None:
        """End the actor: ``graceful`` lets the current step finish and flushes chunks; otherwise
        every task is cancelled now. The first reason given is the one reported."""
        self.peer.stop(code, reason, graceful=graceful)

    # ---- role hooks of the peer lifecycle ---------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """Capacity for the trainer's dispatch: free sequences, and free groups of the largest size seen."""
        queued = sum(len(op.resume) or op.n for op in self._inbox if isinstance(op, SubmitGroup))
        live = len(self.samples.streams) + queued
        free_seqs = max(0, self.gen.engine.max_num_seqs - live)
        return Heartbeat(policy_version=self.engine.weight_version, batch_size=len(self.samples.streams),
                         free_groups=free_seqs // self._largest_group, free_seqs=free_seqs)

    def on_tick(self) -> None:
        """``Stats`` every ``stats_s``, unless the outbox is full."""
        if time.monotonic() - self._last_stats >= self.gen.stats_s and self.peer.queued < self.gen.max_outbox:
            self._last_stats = time.monotonic()
            self.peer.put(self._stats())

    def on_new_trainer(self) -> None:
        """A restarted trainer numbers its own policy and drafter versions and never answers the old
        incarnation's fetches: forget those fetches and announcements, and drop the complete versions
        not yet applied (a new trainer may publish other weights under the same number). Live and
        queued groups are dropped without another chunk: the trainer no longer counts them as ours (a
        trainer that declared us gone resumes them, perhaps here under the same ids, and the old copy's
        chunks would then count as refusals of the new one; a new trainer never knew them)."""
        self.policy_updates.reset()
        self.drafter_updates.reset()
        old_incarnation = ReadyWeights | ReadyDrafter | SubmitGroup | Abort
        self._inbox = deque(op for op in self._inbox if not isinstance(op, old_incarnation))
        dropped = self.samples.abandon()
        if dropped:
            log.info("%d live groups dropped: the trainer resumes them from what it holds", dropped)

    def flush(self) -> None:
        """A graceful stop: chunks of what was emitted, and the last ``Stats``."""
        self.samples.flush()
        self.peer.put(self._stats())

    def _stats(self) -> Stats:
        spec = None
        if self.samples.speculative:
            s = self.engine.spec_stats
            spec = SpecStats(num_drafted=s.num_drafted, num_accepted=s.num_accepted, num_draft_steps=s.num_draft_steps,
                             drafter_version=self.drafter.version)
        prefix = self.engine.block_manager.prefix_counters
        return Stats(policy_version=self.engine.weight_version, num_steps=self.num_steps,
                     num_tokens=self.samples.num_tokens, busy_s=self.busy_s, idle_s=self.idle_s, spec=spec,
                     drafter_version=self.drafter.version, prompt_tokens=prefix.prompt_tokens,
                     cached_prompt_tokens=prefix.cached_prompt_tokens)

    # ---- receiving --------------------------------------------------------------------------

    async def on_message(self, r: Received[ToGenerator]) -> None:
        """Queue engine work for the step loop; fetch announced weights and drafters. Every count
        and size a message carries is bounded first (``submit_limits.py``, ``check_announcement``):
        one over its bound is answered with an ``Error`` and nothing is queued or fetched."""
        msg = r.msg
        try:
            self._check_limits(msg)
        except LimitExceeded as e:
            await self.peer.refuse("bad_request", str(e), r.seq, msg.group_id if isinstance(msg, SubmitGroup) else None)
            return
        match msg:
            case SubmitGroup() | Abort() | ResetPrefixCache():
                if not self.peer.welcomed:
                    await self.peer.refuse("unknown_peer", f"{type(msg).__name__} before Welcome", r.seq)
                    return
                if isinstance(msg, SubmitGroup):
                    self._largest_group = max(self._largest_group, msg.n)
                self._queue(msg)
            case WeightsAvailable():
                self.policy_updates.on_announced(msg)
            case WeightsChunk():
                if (why := self.policy_updates.on_chunk(msg, r.tensors)) is not None:
                    await self.peer.refuse("bad_request", why, r.seq)
            case WeightsGroup():
                if (why := self.policy_updates.group.on_group(msg)) is not None:
                    await self.peer.refuse("bad_request", why, r.seq)
            case WeightsBroadcast():
                if (why := self.policy_updates.group.on_broadcast(msg)) is not None:
                    await self.peer.refuse("bad_request", why, r.seq)
            case DrafterAvailable():
                f = self.drafter_updates.fetch.fetching
                self.drafter_updates.on_announced(msg.version, received=any(
                    isinstance(op, ReadyDrafter) and op.version == f for op in self._inbox))
            case DrafterWeights():
                if (why := await self.drafter_updates.on_weights(msg, r.tensors)) is not None:
                    await self.peer.refuse("bad_request", why, r.seq)
            case Welcome() | Refuse() | Credit() | Error() | Dead():
                raise AssertionError(f"{type(msg).__name__} is the peer connection's")  # PeerConnection handles it
            case _:
                assert_never(msg)

    def _check_limits(self, msg: ToGenerator) -> None:
        """Bound what ``msg`` asks for by this generator's engine and model, before any work.

        Raises:
            LimitExceeded: naming the field, its value and the limit.
        """
        match msg:
            case SubmitGroup() | Abort():
                self.limits.check(msg)
            case WeightsAvailable():
                self.policy_updates.check(msg)
            case _:
                pass  # a drafter version is bounded where it is fetched; nothing else asks for work by a number

    def _queue(self, op: SubmitGroup | Abort | ResetPrefixCache | ReadyWeights | ReadyDrafter) -> None:
        """Queue engine work for the step loop and wake it."""
        self._inbox.append(op)
        self.peer.wake.notify()

    # ---- the step loop: the only code touching the engine -----------------------------------

    async def serve(self) -> None:
        """The step loop, beside the weights group's receiving task (which only waits when unused)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.policy_updates.group.run)
            await self._step_loop()
            tg.cancel_scope.cancel()

    async def _step_loop(self) -> None:
        """Until a stop, apply queued work, then one engine step in a worker thread."""
        self._last_stats = time.monotonic()
        while not self.peer.stopping:
            await self._apply_inbox()
            if self.peer.stopping:
                break
            if not self.engine.has_unfinished():
                start = time.monotonic()
                if not self._inbox:
                    await self.peer.wake.wait()
                self.idle_s += time.monotonic() - start
                continue
            while self.peer.queued >= self.gen.max_outbox and not self.peer.stopping:
                await self.peer.outbox_changed.wait()  # backpressure: the trainer is behind
            start = time.monotonic()
            outputs = await anyio.to_thread.run_sync(self.engine.step)
            self.busy_s += time.monotonic() - start
            self.num_steps += 1
            self.samples.on_outputs(outputs)

    async def _apply_inbox(self) -> None:
        self.samples.drop_abandoned()
        while self._inbox and not self.peer.stopping:
            op = self._inbox.popleft()
            match op:
                case SubmitGroup():
                    await self._submit(op)
                case Abort():
                    await self._abort(op)
                case ResetPrefixCache():
                    self._reset_prefix_cache(op)
                case ReadyWeights():
                    await self._apply_weights(op)
                case ReadyDrafter():
                    self._apply_drafter(op)
                case _:
                    assert_never(op)

    async def _submit(self, msg: SubmitGroup) -> None:
        try:
            self.samples.submit(msg)
        except SampleRefused as e:
            await self.peer.refuse(e.code, str(e), group_id=msg.group_id)
        else:
            log.debug("group %s: %d samples queued", msg.group_id, len(self.samples.groups.get(msg.group_id, ())))

    async def _abort(self, msg: Abort) -> None:
        try:
            self.samples.abort(msg.group_id)
        except SampleRefused as e:
            await self.peer.refuse(e.code, str(e))

    def _reset_prefix_cache(self, msg: ResetPrefixCache) -> None:
        """Forget the prefix cache (between steps: no step is keying pages now) and acknowledge."""
        forgotten = self.engine.block_manager.forget_cached()
        log.info("prefix cache reset: %d cached pages forgotten (request %d)", forgotten, msg.request_id)
        self.peer.put(AckResetPrefixCache(request_id=msg.request_id))

    def _apply_drafter(self, ready: ReadyDrafter) -> None:
        start = time.monotonic()
        self.samples.flush()
        self.peer.put(self.drafter.swap(ready))
        self.drafter_updates.swapped(ready.version)
        self.sync.pause_s += time.monotonic() - start

    async def _apply_weights(self, op: ReadyWeights) -> None:
        start = time.monotonic()
        self.samples.flush()
        try:
            await anyio.to_thread.run_sync(self.engine.update_weights, op.tensors, op.version)
        except ValueError as e:
            log.error("policy version %d refused, still serving %d: %s", op.version, self.engine.weight_version, e)
            self.peer.put(Error(code="bad_request", message=f"policy version {op.version} refused: {e}"))
            self.policy_updates.applied(op.version, refused=True)
            return
        if self.gen.kv_policy == "recompute":
            self.samples.recompute()
        self.sync.applied(sum(t.nbytes for t in op.tensors.values()), op.fetch_started, time.monotonic() - start)
        log.info("serving policy version %d (%d live samples, kv_policy=%s)", op.version, len(self.samples.streams),
                 self.gen.kv_policy)
        self.peer.put(AckWeights(version=op.version))
        self.policy_updates.applied(op.version, refused=False)

# ---- process entry point --------------------------------------------------------------------


async def run_generator(config: RunConfig, connect: str, actor_id: str) -> int:
    """Load the engine ``config.generator.engine`` describes, connect to the trainer at ``connect`` as
    ``actor_id`` and serve until stopped; return the exit code."""
    engine, counter = build_engine(config)
    served: list[GeneratorActor] = []  # the actor, once made: what a scrape reads
    model_name = config.server.model_name or config.model.name
    log.info("generator %s: model %s loaded (%s, %s); connecting to %s", actor_id, config.generator.engine.model,
             engine.dtype, engine.device, connect)
    keys = peer_keys(config, "generator", log)
    limits = SubmitLimits.of(engine, config.generator.engine.max_num_seqs)
    with serving_metrics(config, "generator", actor_id,  # a port in use: MetricsBindError before connecting
                         lambda: collect_generator(served[0], model_name, actor_id) if served else iter(())):
        async with trainer_channel(connect, actor_id, ToGenerator, config.network.window, config.generator.linger_s,
                                   keys, max_header_bytes=limits.max_header_bytes(),
                                   max_tensor_bytes=max_tensor_bytes(engine.model_config)) as channel:
            served.append(GeneratorActor(config, engine, channel, counter, connect=connect, actor_id=actor_id))
            return await served[0].run()
