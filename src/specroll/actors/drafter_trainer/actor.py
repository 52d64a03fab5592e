"""The drafter-trainer actor: trains the EAGLE drafter online and publishes drafter versions.

It connects to the trainer like a generator (DEALER → the trainer's ROUTER, ``Hello(role="drafter")``)
and runs, in one anyio task group:

* **receive** — ``FinishedRollouts`` (queued for the learner), ``WeightsAvailable`` /
  ``WeightsChunk`` (the current policy, fetched like a generator; applied between training steps),
  ``Capacity`` (the generators' live load and the trainer's pause request);
* **train** — when the schedule allows (below), one :meth:`DrafterLearner.step` at a time in a
  worker thread; every ``publish_every`` steps a snapshot goes to the trainer as
  :class:`PublishDrafter` (the next drafter version, recording the policy version it was trained
  against and its checksum), and is saved to ``save_dir`` when one is given;
* **send**, **tick** (heartbeats), **watchdog** (exit 3 when the trainer is gone for
  ``network.heartbeat_timeout_s``; exit 0 when it said ``Dead`` and did not come back), **signals** (SIGTERM
  or SIGINT: stop at once) — the shared peer lifecycle
  (:class:`~specroll.actors.peer.lifecycle.PeerConnection`), of which this actor is a role.

Schedule (TLT's "train on idle capacity", arXiv 2511.16665 §4): a step starts only when the trainer
has not asked to pause, the generators' live batch is at most ``train_below`` of their capacity
(the tail phase; with no load reported yet it counts as idle) and the duty cycle allows it: after
a step of ``t`` seconds the trainer waits ``t · (1/duty_cycle − 1)``. ``num_threads`` caps its
cores. A pause or a load change takes effect before the next step (each is a few seconds at most).

Run as ``specroll drafter serve --connect tcp://127.0.0.1:PORT --config RUN_DIR/config.toml``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import assert_never

import anyio
import anyio.abc
import torch

from specroll.actors.config import RunConfig
from specroll.actors.peer.lifecycle import PeerConnection
from specroll.actors.peer.trainer_channel import trainer_channel
from specroll.actors.peer.weights_fetch import FetchAbandoned, WeightsFetch, check_announcement
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.actors.shared.security import peer_keys
from specroll.actors.telemetry.drafter_metrics import collect_drafter
from specroll.actors.telemetry.endpoint import serving_metrics
from specroll.drafter.eagle_config import DrafterError, max_tensor_bytes
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.learner import DrafterLearner, DrafterSnapshot
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.loaders.sealed import read_newest
from specroll.engine.model import CausalLM
from specroll.protocol.channel import Channel, Received
from specroll.protocol.codec import pack_tensors
from specroll.protocol.limits import MAX_GROUP_SIZE, MAX_VERSION, LimitExceeded, check_at_most
from specroll.protocol.messages import (
    AckWeights,
    Capacity,
    Credit,
    Dead,
    DrafterAvailable,
    Error,
    FetchWeights,
    FinishedRollouts,
    Heartbeat,
    PublishDrafter,
    Refuse,
    ToDrafter,
    WeightsAvailable,
    WeightsChunk,
    Welcome,
)

log = logging.getLogger("specroll.drafter")



DRAFTER_DIRNAME = "drafter"
"""Where in the run directory the drafter trainer saves its latest published version."""


def save_dir(config: RunConfig) -> Path:
    """``RUN_DIR/drafter``: the latest published version is written there (a sealed folder: whole or
    not at all, with checksums; the version before it kept as ``RUN_DIR/drafter.prev``). A drafter
    found there (a resumed run's) is the warm start, before ``drafter.path``; one that fails its
    checksums, does not load or does not fit the model is passed over with a warning, for
    ``drafter.prev``, then ``drafter.path``, then a cold start."""
    return Path(config.run_dir) / DRAFTER_DIRNAME


class DrafterActor:
    """Trains ``learner`` on the trainer's rollouts and publishes drafter versions (module docstring).

    Args:
        config: the run config; the actor reads ``[drafter]`` (schedule, publishing, ``linger_s``),
            ``generator.heartbeat_s`` (its heartbeats), ``network.heartbeat_timeout_s`` (the
            trainer's liveness) and ``model.name``, and saves to :func:`save_dir`.
        learner: the learner (holding the policy's weights and, after a warm start, a head).
        channel: a DEALER channel connected to the trainer, inbound union ``ToDrafter``.
        connect: the trainer's endpoint (log lines).
        actor_id: this process's id (``Hello``, ``Dead``).
    """

    def __init__(self, config: RunConfig, learner: DrafterLearner, channel: Channel[ToDrafter], *, connect: str,
                 actor_id: str) -> None:
        self.config = config
        self.drafter = config.drafter
        self.learner = learner
        self.capacity = Capacity(live_seqs=0, max_seqs=0)
        self._first_capacity = anyio.Event()
        """Set by the trainer's first ``Capacity``: it follows the drafter version the trainer announces
        to a joining drafter trainer, so a warm start is numbered above it only after this."""
        """The last load the trainer reported."""
        self.train_s = 0.0
        """Seconds spent in training steps."""
        self.last_metrics: dict[str, float] = {}
        self.rollouts_received = 0
        """Finished rollouts the trainer sent (``specroll:drafter_rollouts``)."""
        self._rollouts: list[tuple[list[int], int, int]] = []
        """Received, not yet in the learner (added between steps)."""
        self._policy: tuple[int, dict[str, torch.Tensor]] | None = None
        """A complete policy version, not yet in the learner."""
        self._fetch: WeightsFetch | None = None
        self._announced: WeightsAvailable | None = None
        self._weight_shapes = {name: tuple(t.shape) for name, t in learner.target.hf_weights().items()}
        """The target's parameters: what a policy version must hold."""
        self.peer: PeerConnection[ToDrafter] = PeerConnection(
            channel, role="drafter", name="drafter trainer", actor_id=actor_id, endpoint=connect,
            heartbeat_s=config.generator.heartbeat_s, trainer_timeout_s=config.network.heartbeat_timeout_s,
            reconnect_timeout_s=config.network.reconnect_s(),
            linger_s=self.drafter.linger_s, log=log)

    async def run(self) -> int:
        """Serve until a signal, a refusal or the trainer's loss; return the exit code."""
        return await self.peer.run(self)

    def stop(self, code: int, reason: str) -> None:
        """End the actor now; the first reason given is the one reported."""
        self.peer.stop(code, reason)

    # ---- role hooks of the peer lifecycle ---------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """Liveness only: the drafter trainer decodes nothing."""
        return Heartbeat(policy_version=self.learner.policy_version, batch_size=0, free_groups=0, free_seqs=0)

    def on_tick(self) -> None:
        """Nothing periodic besides the heartbeat."""

    def flush(self) -> None:
        """Nothing to flush: the training loop never ends by itself (a stop cancels it)."""

    def on_new_trainer(self) -> None:
        """A restarted trainer numbers its own policy versions and never answers the old incarnation's
        fetch: forget the fetch, the announcement and a version not yet in the learner (rollouts stay)."""
        self._announced, self._fetch, self._policy = None, None, None

    async def on_message(self, r: Received[ToDrafter]) -> None:
        """Queue rollouts and the policy for the learner (between steps); track load and versions."""
        msg = r.msg
        match msg:
            case FinishedRollouts():
                try:
                    self._check_rollouts(msg)
                except LimitExceeded as e:
                    await self.peer.refuse("bad_request", str(e), r.seq)
                    return
                self.rollouts_received += len(msg.rollouts)
                for ro in msg.rollouts:
                    if ro.token_ids and ro.prompt_token_ids:
                        self._rollouts.append((ro.prompt_token_ids + ro.token_ids, len(ro.prompt_token_ids),
                                               ro.policy_version))
                self.peer.wake.notify()
            case Capacity():
                self._first_capacity.set()
                self.capacity = msg
                self.peer.wake.notify()
            case WeightsAvailable():
                problem = self._policy_mismatch(msg)
                if problem is not None:
                    self.stop(EXIT_REFUSED, problem)
                    return
                try:
                    check_announcement(msg, self._weight_shapes)
                except LimitExceeded as e:
                    await self.peer.refuse("bad_request", str(e), r.seq)
                    return
                self._announced = msg
                self._maybe_fetch()
            case WeightsChunk():
                self._on_weights_chunk(msg, r.tensors)
            case DrafterAvailable():
                try:
                    check_at_most("DrafterAvailable.version", msg.version, MAX_VERSION, "protocol limit")
                except LimitExceeded as e:
                    await self.peer.refuse("bad_request", str(e), r.seq)
                    return
                if msg.version > self.learner.version:
                    log.info("drafter version %d is published; numbering ours above it", msg.version)
                    self.learner.version = msg.version
            case Welcome() | Refuse() | Credit() | Error() | Dead():
                raise AssertionError(f"{type(msg).__name__} is the peer connection's")  # PeerConnection handles it
            case _:
                assert_never(msg)

    def _check_rollouts(self, msg: FinishedRollouts) -> None:
        """Bound a ``FinishedRollouts`` before anything of it is copied: at most a group's worth of
        rollouts, each no longer than the target's context (its generator's context is at most that).

        Raises:
            LimitExceeded: naming the field, its value and the limit.
        """
        check_at_most("FinishedRollouts.len(rollouts)", len(msg.rollouts), MAX_GROUP_SIZE, "protocol limit")
        context = self.learner.target.config.max_position_embeddings
        for i, ro in enumerate(msg.rollouts):
            check_at_most(f"FinishedRollouts.rollouts[{i}]: len(prompt_token_ids) + len(token_ids)",
                          len(ro.prompt_token_ids) + len(ro.token_ids), context,
                          "the target's context, max_position_embeddings")

    def _policy_mismatch(self, a: WeightsAvailable) -> str | None:
        """Why the announced policy cannot be this learner's target (another model), or ``None``."""
        mine = self._weight_shapes
        theirs = {p.name: tuple(p.shape) for p in a.params}
        if mine == theirs:
            return None
        diff = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))[:3]
        shown = ", ".join(f"{n}: {theirs.get(n)} there, {mine.get(n)} here" for n in diff)
        return (f"the trainer's policy (version {a.version}) is not the model this drafter trainer loaded "
                f"({self.config.model.name}): {shown}; start it with the run's config (--config RUN_DIR/config.toml)")

    def _maybe_fetch(self) -> None:
        a = self._announced
        have = self._policy[0] if self._policy is not None else self.learner.policy_version
        if a is None or a.version <= have or (self._fetch is not None and self._fetch.version >= a.version):
            return
        self._fetch = WeightsFetch.announced(a, self._weight_shapes)
        self.peer.put(FetchWeights(version=a.version))

    def _on_weights_chunk(self, msg: WeightsChunk, tensors: dict[str, torch.Tensor]) -> None:
        f = self._fetch
        if f is None or msg.version != f.version:
            log.warning("weights chunk %d/%d of version %d was not fetched; ignored", msg.index, msg.num_chunks,
                        msg.version)
            return
        try:
            complete = f.add(msg, tensors)
        except FetchAbandoned as e:
            log.warning("%s; the fetch is dropped (the next announcement starts over)", e)
            self._fetch = None
            return
        if complete is not None:
            self._fetch = None
            self._policy = (f.version, complete)
            self.peer.wake.notify()
            self._maybe_fetch()

    # ---- training ---------------------------------------------------------------------------

    def may_train(self) -> bool:
        """The schedule (module docstring) allows a step now, and the learner has data."""
        c = self.capacity
        idle = c.max_seqs == 0 or c.live_seqs <= self.drafter.train_below * c.max_seqs
        pending = len(self._rollouts) + self.learner.num_rollouts
        return not c.pause and idle and pending >= (1 if self.learner.head else self.learner.config.min_rollouts)

    async def serve(self) -> None:
        """Publish a warm start once the trainer told us its drafter version (a restarted drafter
        trainer numbers its versions above the published one), then train whenever the schedule
        allows (until stopped)."""
        if self.learner.head is not None:
            with anyio.move_on_after(self.peer.trainer_timeout_s):
                await self._first_capacity.wait()
            await self._publish()
        while True:
            await self._apply_pending()
            if not self.may_train():
                with anyio.move_on_after(0.5):
                    await self.peer.wake.wait()
                continue
            start = time.monotonic()
            self.last_metrics = await anyio.to_thread.run_sync(self.learner.step)
            took = time.monotonic() - start
            self.train_s += took
            if self.learner.steps % self.drafter.publish_every_steps == 0:
                await self._publish()
            rest = took * (1 / self.drafter.duty_cycle - 1)
            if rest > 0:
                await anyio.sleep(rest)

    async def _apply_pending(self) -> None:
        """Hand received rollouts and a complete policy version to the learner (between steps)."""
        rollouts, self._rollouts = self._rollouts, []
        for ids, prompt_len, version in rollouts:
            try:
                self.learner.add_rollout(ids, prompt_len, version)
            except ValueError as e:
                log.warning("rollout ignored: %s", e)
        if self._policy is not None:
            version, tensors = self._policy
            self._policy = None
            try:
                await anyio.to_thread.run_sync(self.learner.set_policy, tensors, version)
            except ValueError as e:
                log.error("policy version %d refused: %s", version, e)
                self.peer.put(Error(code="bad_request", message=f"policy version {version} refused: {e}"[:500]))
            else:
                log.info("training against policy version %d", version)
                self.peer.put(AckWeights(version=version))

    async def _publish(self) -> None:
        snap: DrafterSnapshot = await anyio.to_thread.run_sync(self.learner.snapshot)
        refs, tensors = pack_tensors(sorted(snap.tensors.items()))
        self.peer.put(PublishDrafter(version=snap.version, policy_version=snap.policy_version, config=snap.config_json,
                                 checksum=snap.checksum, tensors=refs, train_steps=snap.train_steps,
                                 train_s=round(min(self.train_s, 1e9), 3)), tensors)
        m = self.last_metrics
        log.info("sent drafter version %d to the trainer (policy %d, %d steps, %.0f s of training%s)", snap.version,
                 snap.policy_version, snap.train_steps, self.train_s,
                 f", loss {m['loss']:.3f}, top-1 {m['top1_0']:.3f}" if m else "")
        assert self.learner.head is not None
        directory = save_dir(self.config)
        try:
            await anyio.to_thread.run_sync(self.learner.head.save, directory, True)
        except OSError as e:
            log.warning("cannot save drafter version %d to %s: %s", snap.version, directory, e)


# ---- process entry point --------------------------------------------------------------------


def build_learner(config: RunConfig) -> DrafterLearner:
    """The learner: the policy's (``model.name``) initial weights, float32, on ``drafter.device``,
    trained with :meth:`DrafterConfig.learner_config`, and the warm-start head if any: the last
    drafter this run saved (:func:`save_dir`: a restarted or resumed drafter trainer goes on from
    its newest version, not back to where the run began), else ``drafter.path``.

    Raises:
        CheckpointError: the model cannot be loaded.
        DrafterError: ``drafter.path`` holds no drafter, or one made for another model; or a cold
            start's ``drafter.draft_vocab_size`` exceeds the model's vocabulary (as ``specroll launch``
            refuses it).
    """
    d = config.drafter
    torch.set_num_threads(d.num_threads)
    checkpoint = load_checkpoint(config.model.name, dtype=torch.float32)
    with torch.device("meta"):
        model = CausalLM(checkpoint.config)
    model = model.to_empty(device=torch.device(d.device))
    model.load_weights(checkpoint.weights)

    def own(folder: Path) -> EagleHead:
        head = EagleHead.load(folder)
        head.check_target(checkpoint.config, str(folder))
        return head

    saved = read_newest(save_dir(config), own, refuse=(DrafterError,))
    refused = "".join(f"; refused {e}" for e in saved.refused)
    head = saved.value
    if head is not None:
        log.log(logging.WARNING if refused else logging.INFO, "warm start from %s (the last drafter this run "
                "saved)%s", saved.path, refused)
    elif refused:
        log.warning("no drafter this run saved is usable%s; starting %s", refused,
                    f"from {d.path}" if d.path is not None else "cold")
    if head is None and d.path is not None:
        head = EagleHead.load(d.path)
        log.info("warm start from %s (drafter.path)", d.path)
    vocab = checkpoint.config.vocab_size
    if head is None and d.draft_vocab_size > vocab:  # a cold start: never cap it silently
        raise DrafterError(f"drafter.draft_vocab_size={d.draft_vocab_size} exceeds the vocabulary of "
                           f"{config.model.name} ({vocab} tokens); expected at most {vocab}")
    eos = sorted(set(checkpoint.tokenizer.eos_token_ids) | set(checkpoint.config.eos_token_ids))
    return DrafterLearner(model, d.learner_config(config.seed), head=head, eos_token_ids=eos)


async def run_drafter(config: RunConfig, connect: str, actor_id: str) -> int:
    """Load the policy, connect to the trainer at ``connect`` as ``actor_id`` and train until stopped;
    return the exit code."""
    learner = build_learner(config)
    log.info("drafter trainer %s: model %s loaded; %s; connecting to %s", actor_id, config.model.name,
             "cold start" if learner.head is None else "warm start (from the folder named above)", connect)
    keys = peer_keys(config, "drafter", log)
    served: list[DrafterActor] = []  # the actor, once made: what a scrape reads
    with serving_metrics(config, "drafter", actor_id,  # a port in use: MetricsBindError before connecting
                         lambda: collect_drafter(served[0], actor_id) if served else iter(())):
        async with trainer_channel(connect, actor_id, ToDrafter, config.network.window, config.drafter.linger_s,
                                   keys, max_tensor_bytes=max_tensor_bytes(learner.target.config)) as channel:
            served.append(DrafterActor(config, learner, channel, connect=connect, actor_id=actor_id))
            return await served[0].run()
