"""The generator actor: one :class:`~specroll.engine.engine.Engine` behind a DEALER socket.

Tasks (one anyio task group on the asyncio backend):

* **receive** — the channel's one receive task: answers bad frames with ``Error`` (or a log line),
  queues engine work (``SubmitGroup``, ``Abort``, a complete weight version) for the step loop,
  assembles ``WeightsChunk``s;
* **step loop** — the only code that touches the engine: applies queued work between steps, runs
  ``Engine.step`` in a worker thread, turns its deltas into ``RolloutChunk``s;
* **send** — drains the outbox through the channel (waiting for the trainer's credit), so a slow
  trainer delays decoding only once the outbox is full (bounded memory);
* **tick** — ``Heartbeat`` every ``heartbeat_s`` and ``Stats`` every ``stats_s``;
* **watchdog** — exits non-zero when the trainer has been unreachable (no connection, no message)
  for ``trainer_timeout_s``; **signals** — SIGTERM/SIGINT stop stepping, flush, send ``Dead``, exit 0.

Message flow with the trainer: ``Hello`` → ``Welcome`` | ``Refuse``; ``SubmitGroup`` → chunks of
each sample (the last ``finished``); ``Abort`` → final chunks with ``"abort"``;
``WeightsAvailable`` → ``FetchWeights`` → ``WeightsChunk``s → applied between steps → ``AckWeights``.

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
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import assert_never

import anyio
import anyio.abc
import torch
import zmq
import zmq.asyncio

from specroll.actors.generator.drafter_swap import DrafterFetch, DrafterSlot, ReadyDrafter, check_drafter
from specroll.actors.generator.live_samples import LiveSamples, SampleRefused
from specroll.actors.generator.rollout_stream import DraftCounter
from specroll.actors.generator.settings import GeneratorSettings, build_engine
from specroll.actors.peer.exit import EXIT_OK, EXIT_REFUSED, EXIT_TRAINER_LOST, failure, report_exit
from specroll.actors.peer.trainer_liveness import TrainerLiveness
from specroll.actors.peer.weights_fetch import FetchAbandoned, WeightsFetch
from specroll.drafter.eagle_head import DrafterError
from specroll.engine.engine import Engine
from specroll.protocol.channel import Channel, Received, SequenceError
from specroll.protocol.codec import ProtocolError
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AckDrafter,
    AckWeights,
    Credit,
    Dead,
    DrafterAvailable,
    DrafterWeights,
    Error,
    ErrorCode,
    FetchDrafter,
    FetchWeights,
    Heartbeat,
    Hello,
    Refuse,
    RolloutChunk,
    SpecStats,
    Stats,
    SubmitGroup,
    ToGenerator,
    WeightsAvailable,
    WeightsChunk,
    Welcome,
)
from specroll.protocol.sockets import close_socket, make_socket

log = logging.getLogger("specroll.generator")

_Outbound = RolloutChunk | FetchWeights | AckWeights | FetchDrafter | AckDrafter | Stats | Hello | Error


@dataclass
class _ApplyWeights:
    """A complete policy version, queued for the step loop."""

    version: int
    tensors: dict[str, torch.Tensor]


class _Wakeup:
    """Level-triggered wake-up: :meth:`notify` wakes every task waiting now."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class GeneratorActor:
    """Serves one engine to one trainer over ``channel`` (see the module docstring).

    Args:
        settings: the actor's settings.
        engine: a ready engine (built with ``settings``); only this actor's step loop touches it.
        channel: a DEALER channel connected to the trainer, inbound union ``ToGenerator``.
        draft_counter: the engine's proposer when speculating (for per-chunk ``SpecStats``).
    """

    def __init__(
        self, settings: GeneratorSettings, engine: Engine, channel: Channel[ToGenerator],
        draft_counter: DraftCounter | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.channel = channel
        self.drafter = DrafterSlot(engine, draft_counter, settings.drafter_kv_cache_gb, settings.seed)
        """The learned drafter served (``speculative="eagle"``) and its version."""
        self._drafter_fetch = DrafterFetch()
        self.samples = LiveSamples(engine, self.drafter, self._put, settings.stream_every,
                                   settings.speculative != "off")
        self._inbox: deque[SubmitGroup | Abort | _ApplyWeights | ReadyDrafter] = deque()
        """Engine work for the step loop, in arrival order."""
        self._outbox: deque[_Outbound] = deque()
        self._sending = False
        self._wake, self._outbox_changed = _Wakeup(), _Wakeup()
        self._welcomed = anyio.Event()
        self._announced: WeightsAvailable | None = None
        self._fetch: WeightsFetch | None = None
        self._largest_group = 1
        self._stopping = False
        self._exit: tuple[int, str] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.trainer = TrainerLiveness(settings.connect, settings.trainer_timeout_s, log)
        self._last_hello = 0.0
        self._num_steps = 0
        self._busy_s = self._idle_s = 0.0

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until a signal, a refusal or the trainer's loss; send ``Dead``; return the exit code
        (0 after SIGTERM/SIGINT, 2 refused, 3 trainer unreachable, 1 an internal failure)."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._receive_loop)
                tg.start_soon(self._send_loop)
                tg.start_soon(self.trainer.watchdog, self._trainer_lost)
                tg.start_soon(self.trainer.watch_connection, self.channel.socket)
                tg.start_soon(self._watch_signals)
                await self._handshake()
                tg.start_soon(self._tick)
                await self._step_loop()
                with anyio.move_on_after(self.settings.linger_s):  # graceful stop: flush what was emitted
                    self.samples.flush()
                    self._put(self._stats())
                    while self._outbox or self._sending:
                        await self._outbox_changed.wait()
                tg.cancel_scope.cancel()
        except Exception as e:  # an internal failure: reported as the actor's death
            log.exception("generator %s failed", self.settings.actor_id)
            self._exit = failure(e)
        return await report_exit(self.channel, self.settings.actor_id, self._exit, self.settings.linger_s, log,
                                 "generator")

    def stop(self, code: int, reason: str, *, graceful: bool) -> None:
        """End the actor: ``graceful`` lets the current step finish and flushes chunks; otherwise
        every task is cancelled now. The first reason given is the one reported."""
        if self._exit is None:
            self._exit = (code, reason)
        self._stopping = True
        self._wake.notify()
        self._outbox_changed.notify()
        if not graceful and self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def _handshake(self) -> None:
        self._send_hello()
        with anyio.move_on_after(self.settings.trainer_timeout_s):
            await self._welcomed.wait()
        if not self._welcomed.is_set():
            self.stop(EXIT_TRAINER_LOST, f"no Welcome from the trainer at {self.settings.connect} within "
                      f"{self.settings.trainer_timeout_s} s", graceful=False)
            await anyio.sleep_forever()

    def _send_hello(self) -> None:
        self._last_hello = time.monotonic()
        self._put(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id=self.settings.actor_id,
                        capabilities=("resume", "bf16-weights",
                                      *(("speculative",) if self.samples.speculative else ()))))

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if self._stopping:
                    log.warning("second %s: stopping now", name)
                    self.stop(EXIT_OK, f"received {name}", graceful=False)
                else:
                    log.info("received %s: stopping after this step", name)
                    self.stop(EXIT_OK, f"received {name}", graceful=True)

    def _trainer_lost(self, ended: bool, reason: str) -> None:
        self.stop(EXIT_OK if ended else EXIT_TRAINER_LOST, reason, graceful=False)

    # ---- sending ----------------------------------------------------------------------------

    def _put(self, msg: _Outbound) -> None:
        self._outbox.append(msg)
        self._outbox_changed.notify()

    async def _send_loop(self) -> None:
        while True:
            while not self._outbox:
                await self._outbox_changed.wait()
            self._sending = True
            await self.channel.send(self._outbox[0])  # waits for the trainer's credit
            self._outbox.popleft()
            self._sending = False
            self._outbox_changed.notify()

    async def _refuse(self, code: ErrorCode, message: str, seq: int | None = None) -> None:
        """Log a refused inbound message and answer it with ``Error`` when that would not wait for
        credit (the receive task must never block, or credit would never arrive)."""
        log.warning("refused (%s): %s", code, message)
        if self.channel.can_send():
            await self.channel.send(Error(code=code, message=message, seq=seq))

    async def _tick(self) -> None:
        last_stats = time.monotonic()
        while True:
            await anyio.sleep(self.settings.heartbeat_s)
            queued = sum(len(op.resume) or op.n for op in self._inbox if isinstance(op, SubmitGroup))
            live = len(self.samples.streams) + queued
            free_seqs = max(0, self.settings.max_num_seqs - live)
            beat = Heartbeat(policy_version=self.engine.weight_version, batch_size=len(self.samples.streams),
                             free_groups=free_seqs // self._largest_group, free_seqs=free_seqs)
            with anyio.move_on_after(self.settings.heartbeat_s):  # never pile up behind a dead connection
                await self.channel.send(beat)
            if time.monotonic() - last_stats >= self.settings.stats_s and len(self._outbox) < self.settings.max_outbox:
                last_stats = time.monotonic()
                self._put(self._stats())

    def _stats(self) -> Stats:
        spec = None
        if self.samples.speculative:
            s = self.engine.spec_stats
            spec = SpecStats(num_drafted=s.num_drafted, num_accepted=s.num_accepted, num_draft_steps=s.num_draft_steps,
                             drafter_version=self.drafter.version)
        return Stats(policy_version=self.engine.weight_version, num_steps=self._num_steps,
                     num_tokens=self.samples.num_tokens, busy_s=self._busy_s, idle_s=self._idle_s, spec=spec,
                     drafter_version=self.drafter.version)

    # ---- receiving --------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                received = await self.channel.recv()
            except SequenceError as e:
                await self._refuse("sequence", str(e), e.seq)
                if e.seq < e.expected:
                    continue  # a duplicate: already handled
                received = e.received  # a gap: the message itself is fine
            except ProtocolError as e:
                await self._refuse("malformed", str(e), e.seq)
                continue
            self.trainer.heard(dead=isinstance(received.msg, Dead))
            await self._dispatch(received)

    async def _dispatch(self, r: Received[ToGenerator]) -> None:
        msg = r.msg
        if r.first and self._welcomed.is_set():
            log.info("a new trainer session (seq %d): the trainer restarted or a stray peer wrote", r.seq)
        match msg:
            case Welcome():
                if self._welcomed.is_set():
                    await self._refuse("bad_request", f"unexpected Welcome from {msg.actor_id!r}: already welcomed",
                                       r.seq)
                elif msg.protocol_version != PROTOCOL_VERSION:
                    self.stop(EXIT_REFUSED, f"the trainer speaks protocol {msg.protocol_version}, "
                              f"this generator {PROTOCOL_VERSION}", graceful=False)
                else:
                    log.info("welcomed by %s", msg.actor_id)
                    self._welcomed.set()
            case Refuse():
                if self._welcomed.is_set():
                    await self._refuse("bad_request", f"unexpected Refuse after the handshake: {msg.reason}", r.seq)
                else:
                    self.stop(EXIT_REFUSED, f"refused by the trainer: {msg.reason}", graceful=False)
            case SubmitGroup() | Abort():
                if not self._welcomed.is_set():
                    await self._refuse("unknown_peer", f"{type(msg).__name__} before Welcome", r.seq)
                    return
                if isinstance(msg, SubmitGroup):
                    self._largest_group = max(self._largest_group, msg.n)
                self._inbox.append(msg)
                self._wake.notify()
            case WeightsAvailable():
                self._announced = msg
                f = self._fetch
                if f is not None and f.version < msg.version and not f.complete:
                    # A newer version supersedes a transfer still under way (the trainer moved on or
                    # restarted and will never finish the old one): drop it, fetch the new one.
                    log.info("policy version %d supersedes the unfinished fetch of %d", msg.version, f.version)
                    self._fetch = None
                self._maybe_fetch()
            case WeightsChunk():
                await self._on_weights_chunk(msg, r)
            case DrafterAvailable():
                f = self._drafter_fetch.fetching
                self._drafter_fetch.on_announced(msg.version, received=any(
                    isinstance(op, ReadyDrafter) and op.version == f for op in self._inbox))
                self._maybe_fetch_drafter()
            case DrafterWeights():
                await self._on_drafter_weights(msg, r)
            case Credit():
                pass  # consumed by the channel; never handed out
            case Error():
                about = f" about our message {msg.seq}" if msg.seq is not None else ""
                log.warning("the trainer reports an error (%s)%s: %s", msg.code, about, msg.message)
                if msg.code == "unknown_peer" and time.monotonic() - self._last_hello > 1.0:
                    self._send_hello()  # the trainer restarted and does not know us: register again
            case Dead():
                log.info("the trainer (%s) is exiting (%s); waiting for it to come back", msg.actor_id, msg.reason)
            case _:
                assert_never(msg)

    def _maybe_fetch(self) -> None:
        """Fetch the newest announced version when it is newer than what is served or fetched."""
        a = self._announced
        if a is None or self._fetch is not None or a.version <= self.engine.weight_version:
            return
        self._fetch = WeightsFetch.announced(a)
        log.info("fetching policy version %d (%d chunks)", a.version, a.num_chunks)
        self._put(FetchWeights(version=a.version))

    def _maybe_fetch_drafter(self) -> None:
        """Fetch the newest announced drafter version when speculating with a learned drafter."""
        if self.settings.speculative != "eagle" or (v := self._drafter_fetch.next(self.drafter.version)) is None:
            return
        log.info("fetching drafter version %d", v)
        self._put(FetchDrafter(version=v))

    async def _on_drafter_weights(self, msg: DrafterWeights, r: Received[ToGenerator]) -> None:
        if msg.version != self._drafter_fetch.fetching:
            if self._drafter_fetch.superseded(msg.version):
                log.debug("drafter version %d arrived after a newer one was announced; dropped", msg.version)
                return
            await self._refuse("bad_request", f"drafter version {msg.version} was not fetched "
                               f"(fetching {self._drafter_fetch.fetching or None})", r.seq)
            return
        try:
            ready = await anyio.to_thread.run_sync(check_drafter, msg, r.tensors, self.engine)
        except DrafterError as e:
            log.error("%s; still serving drafter version %d", e, self.drafter.version)
            self._put(AckDrafter(version=msg.version, checksum="", refused=str(e)[:500]))
            self._drafter_fetch.refused(self.drafter.version)  # wait for a newer announcement
            return
        self._inbox.append(ready)
        self._wake.notify()

    def _forget_announcement(self, version: int) -> None:
        """A fetch of ``version`` failed: do not fetch it again until it is announced again."""
        if self._announced is not None and self._announced.version == version:
            self._announced = None

    async def _on_weights_chunk(self, msg: WeightsChunk, r: Received[ToGenerator]) -> None:
        f = self._fetch
        if (f is None or msg.version != f.version) and self._announced is not None \
                and msg.version < self._announced.version:
            return  # a chunk of a superseded transfer, still in flight: nothing to do with it
        if f is None or msg.version != f.version or f.complete:
            await self._refuse("bad_request", f"weights chunk {msg.index} of version {msg.version} was not fetched "
                               f"(fetching {f.version if f else None})", r.seq)
            return
        try:
            tensors = f.add(msg, r.tensors)
        except FetchAbandoned as e:
            self._fetch = None  # the version is unusable; a later WeightsAvailable starts over
            self._forget_announcement(msg.version)
            await self._refuse("bad_request", f"{e} (fetch abandoned)", r.seq)
            return
        if tensors is not None:  # complete: the step loop applies it (the fetch stays until then)
            self._inbox.append(_ApplyWeights(msg.version, tensors))
            self._wake.notify()

    # ---- the step loop: the only code touching the engine -----------------------------------

    async def _step_loop(self) -> None:
        while not self._stopping:
            await self._apply_inbox()
            if self._stopping:
                break
            if not self.engine.has_unfinished():
                start = time.monotonic()
                if not self._inbox:
                    await self._wake.wait()
                self._idle_s += time.monotonic() - start
                continue
            while len(self._outbox) >= self.settings.max_outbox and not self._stopping:
                await self._outbox_changed.wait()  # backpressure: the trainer is behind
            start = time.monotonic()
            outputs = await anyio.to_thread.run_sync(self.engine.step)
            self._busy_s += time.monotonic() - start
            self._num_steps += 1
            self.samples.on_outputs(outputs)

    async def _apply_inbox(self) -> None:
        while self._inbox and not self._stopping:
            op = self._inbox.popleft()
            match op:
                case SubmitGroup():
                    await self._submit(op)
                case Abort():
                    await self._abort(op)
                case _ApplyWeights():
                    await self._apply_weights(op)
                case ReadyDrafter():
                    self._apply_drafter(op)
                case _:
                    assert_never(op)

    async def _submit(self, msg: SubmitGroup) -> None:
        try:
            self.samples.submit(msg)
        except SampleRefused as e:
            await self._refuse(e.code, str(e))
        else:
            log.debug("group %s: %d samples queued", msg.group_id, len(self.samples.groups.get(msg.group_id, ())))

    async def _abort(self, msg: Abort) -> None:
        try:
            self.samples.abort(msg.group_id)
        except SampleRefused as e:
            await self._refuse(e.code, str(e))

    def _apply_drafter(self, ready: ReadyDrafter) -> None:
        self.samples.flush()
        self._put(self.drafter.swap(ready, self.samples.token_caps()))
        self._drafter_fetch.done(ready.version)
        self._maybe_fetch_drafter()

    async def _apply_weights(self, op: _ApplyWeights) -> None:
        self.samples.flush()
        try:
            await anyio.to_thread.run_sync(self.engine.update_weights, op.tensors, op.version)
        except ValueError as e:
            log.error("policy version %d refused, still serving %d: %s", op.version, self.engine.weight_version, e)
            self._put(Error(code="bad_request", message=f"policy version {op.version} refused: {e}"))
            self._forget_announcement(op.version)
        else:
            if self.settings.kv_policy == "recompute":
                self.samples.recompute()
            log.info("serving policy version %d (%d live samples, kv_policy=%s)", op.version, len(self.samples.streams),
                     self.settings.kv_policy)
            self._put(AckWeights(version=op.version))
        self._fetch = None
        self._maybe_fetch()

# ---- process entry point --------------------------------------------------------------------


async def run_generator(settings: GeneratorSettings) -> int:
    """Load the engine, connect to the trainer and serve until stopped; return the exit code."""
    engine, counter = build_engine(settings)
    log.info("generator %s: model %s loaded (%s, %s); connecting to %s", settings.actor_id, settings.model,
             engine.dtype, engine.device, settings.connect)
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=settings.connect, identity=settings.actor_id.encode())
    try:
        actor = GeneratorActor(settings, engine, Channel(sock, ToGenerator, window=settings.window), counter)
        return await actor.run()
    finally:
        close_socket(sock, linger_ms=int(settings.linger_s * 1000))  # the final Dead may still be queued
        ctx.term()
