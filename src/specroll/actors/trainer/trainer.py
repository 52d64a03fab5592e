"""The trainer actor: GRPO on rollouts streamed by generators, built on :class:`RolloutClient`.

Run as ``python -m specroll.actors.trainer --config FILE [--set a.b=value ...]`` (no file: the
defaults). Contract with the launcher: the trainer binds ``tcp://{network.host}:{network.trainer_port}``
(port 0: a free one) and, once bound, writes the endpoint to ``RUN_DIR/trainer.endpoint``
(atomically); it writes the resolved config to ``RUN_DIR/config.toml``; after ``steps`` GRPO steps
it closes the client (generators get ``Dead``) and exits 0. Errors end it with one log line and a
non-zero code: 1 a failure, 2 a bad config, 3 no generator connected for ``3 × network.heartbeat_timeout_s``,
128 + signal number after SIGTERM/SIGINT.

Timeline:

1. bind, write the endpoint, load the policy (and the checkpoint, when ``RUN_DIR/checkpoint/``
   exists) while generators start and connect;
2. on resume only — from a checkpoint, or from step 0 when an earlier trainer of the run left no
   checkpoint but left metrics lines or a trainer restart recorded by the launcher
   (``RUN_DIR/restarts.json``); a first start on an empty run directory skips this: wait for a
   generator and for the first heartbeat of every connected one (at most
   ``network.heartbeat_timeout_s``), publish the restored (or initial) weights as version
   ``max(saved version, highest version any generator reports) + 1`` and wait (at most
   ``network.heartbeat_timeout_s``) for the acknowledgements — a generator may serve a version the
   dead trainer published after its last checkpoint, and versions must only ever increase; then drop
   the metrics lines of the steps it trains again (and the evaluation of the step it resumes at, when
   it evaluates those weights again: their line is written again with the new figures);
3. a feeder task submits groups (``client.submit``, prompts in a seeded cyclic order) while
   ``groups queued + in flight + finished but not yet trained`` is below ``trainer.max_groups_in_flight``
   and, AReaL's staleness control (``specroll/rl/admission.py``), the groups submitted and not
   through a finished step — the one being trained included — are fewer than
   ``(trainer.max_staleness + 1) × batch_groups``; it warns at start when ``max_groups_in_flight``
   is above that;
4. step t starts as soon as ``batch_groups`` groups finished (oldest first; the tail never
   blocks it): rewards → padded batch → staleness bound → loss → AdamW, in a worker thread so the
   client keeps receiving; then the new weights are published as the next version, a metrics line is
   appended to ``RUN_DIR/metrics.jsonl`` and the progress line updated; a checkpoint every
   ``checkpoint_every`` steps and at the end. A batch with no token left in the loss (every one
   staler than η) takes no optimizer step and is not counted: a warning, a metrics line with
   ``"skipped": true``, and the next batch is drawn for step t (after every generator serves the
   current version; more than η + 1 such batches in a row end the run with an error);
5. before the last metrics line: wait (at most ``network.heartbeat_timeout_s``) until every
   connected generator acknowledged the final version.

``trainer.mode = "sync"`` replaces 3–4 by the synchronous loop: submit ``batch_groups`` groups, wait
until all of them finished, train, publish, wait until every generator serves the new version.

Held-out evaluation (``[eval]``, ``evaluation.py``): the weights before the first step, after every
``eval.every`` steps and after the last are evaluated by the generators while training goes on; the
next publish waits for it (an ``eval_wait`` phase), and its figures go into the metrics line of the
step whose weights it measured (held until then; the weights before training get a ``step`` 0 line).
Every phase, the groups of each step and each evaluation are also appended to
``RUN_DIR/timeline.jsonl`` (``timeline.py``).

Policy version: the number of optimizer steps taken, plus any jumps made so that a version is
never below one a generator already reports (step 2, and whenever a generator or a rollout token
reports a version above the trainer's; the current weights are then republished above it).

Sharded (``trainer.world_size`` > 1): this process is rank 0 and the only one that talks to
generators; the policy it trains, publishes and checkpoints (``policy.py``) is sharded over the
ranks with FSDP2, each operation a command to the other ranks (``follower.py``).

Beside this module: its start (policy, optimizer, prompts, restore) in ``setup.py``, the prompt
order in ``prompt_cycle.py``, the metrics records in ``metrics.py``, checkpoints in
``checkpoint.py``, the process around it (bind, exit codes) in ``process.py``, the command line
in ``cli.py``; the GRPO maths in ``specroll/rl/`` (``grpo.py``, ``grpo_step.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import msgspec
import torch
from anyio.abc import TaskGroup
from tqdm import tqdm

from specroll.actors.config import RunConfig
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.timeline import Timeline
from specroll.actors.shared.exit_codes import EXIT_PEER_LOST
from specroll.actors.shared.restarts import read_restarts
from specroll.actors.shared.wakeup import Wakeup
from specroll.actors.trainer.checkpoint import TrainerState
from specroll.actors.trainer.evaluation import Evaluator
from specroll.actors.trainer.metrics import StepMetrics, truncate_metrics
from specroll.actors.trainer.setup import TrainerError, TrainerSetup
from specroll.rl.admission import Admission, run_ahead_warning
from specroll.rl.coordinator import Group
from specroll.rl.grpo_step import StepResult, build_batch
from specroll.rl.tasks import Prompt, RewardFn, get_reward

log = logging.getLogger("specroll.trainer")

ENDPOINT_FILENAME = "trainer.endpoint"
METRICS_FILENAME = "metrics.jsonl"
NO_GENERATOR_FACTOR = 3
"""The trainer gives up after ``NO_GENERATOR_FACTOR × network.heartbeat_timeout_s`` without generators."""


# ---- the actor ----------------------------------------------------------------------------------


class Trainer:
    """Drives one run: feeds groups, trains on finished ones, publishes versions (module docstring).

    Args:
        config: the run.
        setup: the loaded policy, optimizer, prompts and restored state.
        client: a started client generators connect to.
    """

    def __init__(self, config: RunConfig, setup: TrainerSetup, client: RolloutClient,
                 timeline: Timeline | None = None) -> None:
        self.config, self.client, self.timeline = config, client, timeline
        self.policy, self.tokenizer = setup.policy, setup.tokenizer
        self.prompts = setup.prompts
        self.step, self.version = setup.state.step, setup.state.policy_version
        self.resumed_from = setup.resumed_from
        self.reward_fn: RewardFn = get_reward(config.task.reward)
        self.run_dir = Path(config.run_dir)
        self.no_generator_s = NO_GENERATOR_FACTOR * config.network.heartbeat_timeout_s
        self._alone_since: float | None = None
        self._check_s = min(1.0, self.no_generator_s / 4)
        """Seconds between checks that some generator is connected, while waiting for one."""
        self._room = Wakeup()
        """Notified when a step takes finished groups or finishes, so the feeder submits more."""
        tc = config.trainer
        self.admission = Admission(tc.batch_groups, tc.max_staleness, tc.max_groups_in_flight)
        self._skipped_in_row = 0
        """Batches in a row with no token to train (``_skip``)."""
        self.step_metrics = StepMetrics(client, config.drafter.acceptance_floor)
        self._last_checkpoint = self.step
        self.evaluator = Evaluator(client, setup.eval_prompts, config.generator.sampling, config.eval.greedy,
                                   self.reward_fn, self.tokenizer, config.network.heartbeat_timeout_s,
                                   self._check_generators, timeline) if setup.eval_prompts else None
        self._untrained: dict[str, int] = {}
        """Training groups submitted and not yet trained: group id → its position in the prompt order
        (saved in checkpoints, so a restarted trainer submits them again)."""
        self._held: dict[str, object] | None = None
        """The metrics line of the step whose weights are being evaluated: written, with the
        evaluation's figures, once it finishes (before the next step's line)."""
        self._tg: TaskGroup | None = None

    async def run(self) -> None:
        """Train until ``config.steps`` steps are done.

        Raises:
            TrainerError: no generator connected for ``3 × heartbeat_timeout_s``.
        """
        if self.timeline is not None:
            self.timeline.record("trainer_start", step=self.step, policy_version=self.version)
        held: dict[str, object] | None = None
        resume = self.resumed_from is not None
        if resume:
            log.info("resuming from %s: step %d, policy version %d", self.resumed_from, self.step, self.version)
            if self.step >= self.config.steps:
                log.info("the checkpoint is already at step %d of %d: nothing to train", self.step, self.config.steps)
                return
        elif self._earlier_incarnation():  # killed before its first checkpoint: it may have published versions
            log.info("an earlier trainer of this run left no checkpoint in %s: starting again from step 0",
                     self.run_dir)
            resume = True
        if resume:
            await self._publish_after_resume()
            held = truncate_metrics(self.run_dir / METRICS_FILENAME, self.step, self._evaluates(self.step))
        sync = self.config.trainer.mode == "sync"
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if not sync:
                tg.start_soon(self._feed)
            if self._maybe_evaluate():  # the weights before the first step: a line of their own
                # (resumed: the step's old line, its evaluation to be replaced by this one's)
                self._held = held or {"step": self.step, "policy_version": self.version, "time": time.time()}
            # disable=None: no bar when stderr is a log file (the launcher prints a line per step instead)
            with tqdm(total=self.config.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                      file=sys.stderr, disable=None) as bar:
                while self.step < self.config.steps:
                    await self._one_step(bar, sync)
            if self._last_checkpoint != self.step:
                await self._checkpoint()
            tg.cancel_scope.cancel()

    # ---- the feeder and the wait ----------------------------------------------------------------

    async def _feed(self) -> None:
        """Submit groups while :class:`Admission` has room: at most ``trainer.max_groups_in_flight``
        queued, generating or finished-untrained, at most (η + 1)·B not through a finished step."""
        tc = self.config.trainer
        if (warning := run_ahead_warning(tc.max_groups_in_flight, tc.batch_groups, tc.max_staleness)) is not None:
            log.warning("%s", warning)
        while True:
            while self.admission.room(self.client.num_pending + self.client.num_finished) > 0:
                await self._submit_next()
                self.admission.on_submit()
            await self._room.wait()  # no await between the check above and this wait: no wake-up is missed

    def _check_generators(self) -> None:
        """Raise once no generator has been connected for ``no_generator_s``."""
        if self.client.coordinator.generators:
            self._alone_since = None
            return
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        elif now - self._alone_since > self.no_generator_s:
            raise TrainerError(
                f"no generator connected to {self.client.endpoint} for {self.no_generator_s:.0f} s "
                f"({NO_GENERATOR_FACTOR} x network.heartbeat_timeout_s); are generators running and pointed here?",
                EXIT_PEER_LOST)

    async def _submit_next(self) -> None:
        """Submit a group of the next prompt (its sampling seed from the prompt order)."""
        draw = self.prompts.next()
        sampling = msgspec.structs.replace(self.config.generator.sampling, seed=draw.seed)
        group_id = await self.client.submit(draw.token_ids, self.config.trainer.group_size, sampling,
                                            payload=draw.prompt)
        self._untrained[group_id] = draw.position

    async def _submit_batch(self) -> None:
        """Sync mode: submit one step's groups."""
        for _ in range(self.config.trainer.batch_groups):
            await self._submit_next()
            self.admission.on_submit()

    async def _wait_for_batch(self) -> list[Group]:
        batch = self.config.trainer.batch_groups
        while self.client.num_finished < batch:
            self._check_generators()
            with anyio.move_on_after(self._check_s):  # woken by the client when groups finish
                await self.client.wait_finished(batch)
        groups = self.client.pop_finished(batch)
        self._room.notify()  # the feeder refills what this step takes
        return groups

    # ---- versions -------------------------------------------------------------------------------

    def _reported_version(self) -> int:
        """Highest policy version any connected generator reports (heartbeat or acknowledgement)."""
        versions = [g.policy_version for g in self.client.coordinator.generators.values()]
        versions += list(self.client.generator_versions.values())
        return max(versions, default=-1)

    async def _publish(self) -> None:
        with self._phase("publish"):
            weights = await anyio.to_thread.run_sync(self.policy.full_weights)  # sharded: gathered from the ranks
            await self.client.publish_weights(weights, self.version, dtype=self.config.trainer.weights_dtype)

    @contextlib.contextmanager
    def _phase(self, phase: str) -> Iterator[None]:
        """Record a ``phase`` span of the trainer in the timeline."""
        start = time.time()
        try:
            yield
        finally:
            if self.timeline is not None:
                self.timeline.record("phase", phase=phase, start=start, end=time.time(), step=self.step + 1)

    # ---- evaluation -----------------------------------------------------------------------------

    def _evaluates(self, step: int) -> bool:
        """Whether the weights of ``step`` are evaluated: every ``eval.every`` steps (step 0, the
        weights before the first step, included) and after the last."""
        return self.evaluator is not None and (step % self.config.eval.every == 0 or step == self.config.steps)

    def _maybe_evaluate(self) -> bool:
        """Start evaluating the current weights before the first step, every ``eval.every`` steps and
        after the last; whether one started."""
        if not self._evaluates(self.step):
            return False
        assert self._tg is not None, "evaluations run inside run()"
        self.evaluator.start(self._tg, self.step, self.version)
        return True

    async def _finish_evaluation(self) -> None:
        """Hold the next publish until a running evaluation finished (its tokens all carry the
        version it evaluates); then write the held metrics line with its figures."""
        if self.evaluator is None or self._held is None:
            return
        with self._phase("eval_wait"):
            evaluation = await self.evaluator.wait()
        held, self._held = self._held, None
        if evaluation is not None:
            held.update(evaluation.metrics())
        self._write_metrics(held)

    def _write_metrics(self, metrics: dict[str, object]) -> None:
        metrics.update(read_restarts(self.run_dir))  # what the launcher restarted so far
        with open(self.run_dir / METRICS_FILENAME, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")

    def _earlier_incarnation(self) -> bool:
        """Whether an earlier trainer of this run left progress in the run directory (metrics lines, or
        a trainer restart the launcher recorded) — without a checkpoint, it may still have published
        versions the generators serve."""
        metrics = self.run_dir / METRICS_FILENAME
        if metrics.is_file() and metrics.stat().st_size > 0:
            return True
        by_role = read_restarts(self.run_dir)["restarts_by_role"]
        return isinstance(by_role, dict) and by_role.get("trainer", 0) > 0

    async def _publish_after_resume(self) -> None:
        """Publish the restored (or, with no checkpoint, initial) weights above every version a
        generator may serve (timeline step 2)."""
        while not self.client.coordinator.generators:
            self._check_generators()
            with anyio.move_on_after(self._check_s):
                await self.client.wait_for_generators(1)
        # every generator connected now reports the version it serves (its first heartbeat), at most
        # heartbeat_timeout_s; one that joins later and serves a higher version is overtaken (_overtake)
        with anyio.move_on_after(self.config.network.heartbeat_timeout_s):
            await self.client.wait_for_generators(len(self.client.coordinator.generators))
        saved, reported = self.version, self._reported_version()
        self.version = max(saved, reported) + 1
        log.info("publishing the %s weights as policy version %d (saved %d, generators report %d)",
                 "restored" if self.resumed_from is not None else "initial", self.version, saved, reported)
        await self._publish()
        await self._wait_acks()

    async def _overtake(self, groups: Sequence[Group]) -> None:
        """A generator or a rollout token reports a version above ours (an earlier incarnation of this
        trainer published it): republish the current weights above it, so versions only increase."""
        tokens = max((v for g in groups for s in g.samples for v in s.versions), default=-1)
        seen = max(self._reported_version(), tokens)
        if seen > self.version:
            log.warning("version %d is in use, above this trainer's %d; republishing the current weights as %d",
                        seen, self.version, seen + 1)
            self.version = seen + 1
            await self._publish()

    async def _wait_acks(self) -> None:
        """Wait (at most ``heartbeat_timeout_s``) until every connected generator serves ``version``."""
        try:
            await self.client.wait_for_version(self.version, timeout=self.config.network.heartbeat_timeout_s)
        except TimeoutError:
            behind = {a: v for a, v in self.client.generator_versions.items() if v < self.version}
            log.warning("not every generator acknowledged policy version %d within %.0f s: %s", self.version,
                        self.config.network.heartbeat_timeout_s, behind or "no acknowledgement yet")

    # ---- one step ----------------------------------------------------------------------------

    async def _one_step(self, bar: tqdm, sync: bool) -> None:
        wait_start = time.monotonic()
        with self._phase("wait"):
            if sync:
                await self._submit_batch()
            groups = await self._wait_for_batch()
        # in the order they were submitted, not finished: a seeded sync run trains the same batch
        # (same rows, same ranks, same float sums) whatever order its rollouts happened to finish in
        groups.sort(key=lambda g: self._untrained.get(g.group_id, math.inf))
        start = time.monotonic()
        await self._overtake(groups)
        trained_version = self.version
        positions = [self._untrained.pop(g.group_id, None) for g in groups]
        if self.timeline is not None:
            self.timeline.record("step_groups", step=self.step + 1, group_ids=[g.group_id for g in groups],
                                 prompt_ids=[g.payload.prompt_id for g in groups if isinstance(g.payload, Prompt)],
                                 positions=positions, resumed=[g.group_id for g in groups if g.dispatches > 1],
                                 resumed_tokens={g.group_id: [smp.token_ids for smp in g.samples]
                                                 for g in groups if g.dispatches > 1})
        pause = self.config.drafter.pause_during_train_step
        if pause:
            self.client.pause_drafter(True)
        try:
            with self._phase("train"):
                rewards, result = await anyio.to_thread.run_sync(self._train, groups, trained_version)
        finally:
            if pause:
                self.client.pause_drafter(False)
        if result.skipped:
            await self._skip(groups, rewards, result, trained_version, time.monotonic() - start, start - wait_start)
            return
        self._skipped_in_row = 0
        await self._finish_evaluation()
        self.step += 1
        self.version += 1
        await self._publish()
        self.admission.on_batch_done()  # sampled after this publish: room for B more (rl/admission.py)
        self._room.notify()
        if sync or self.step == self.config.steps:
            with self._phase("publish"):
                await self._wait_acks()
        metrics = self.step_metrics.record(self.step, self.version, groups, rewards, result, trained_version,
                                           time.monotonic() - start, start - wait_start)
        if self._maybe_evaluate():
            self._held = metrics
        else:
            self._write_metrics(metrics)
        if self.step == self.config.steps:
            await self._finish_evaluation()
        bar.set_postfix_str(_progress(metrics, result), refresh=False)
        bar.update(1)
        every = self.config.trainer.checkpoint_every
        if every and self.step % every == 0:
            await self._checkpoint()

    async def _skip(self, groups: list[Group], rewards: torch.Tensor, result: StepResult, trained_version: int,
                    step_s: float, wait_s: float) -> None:
        """A batch with no token left in the loss: ``train_step`` took no optimizer step, so no step is
        counted and no version published — a user asking for ``steps`` steps gets that many updates on
        data. Its metrics line says ``"skipped": true``; the next batch is drawn for the same step
        once every generator serves the current version, so groups submitted from now on are sampled
        by the weights they train (lag 0). At most η + 1 batches in a row can then be skipped
        (``Admission.max_skipped_in_row``).

        Raises:
            TrainerError: more batches in a row were skipped than that (a generator that does not
                apply new weights, or rollouts without a response token).
        """
        self._skipped_in_row += 1
        eta = self.config.trainer.max_staleness
        log.warning("step %d: no token of its batch is trainable (%d masked as stale, %d samples dropped; "
                    "max_staleness=%d, trained version %d): no optimizer step taken, not counted as a step; "
                    "drawing the next batch", self.step + 1, result.tokens_masked_stale,
                    result.samples_dropped_stale, eta, trained_version)
        if self._skipped_in_row > self.admission.max_skipped_in_row:
            raise TrainerError(
                f"{self._skipped_in_row} batches in a row had no token to train, although every generator was "
                f"sent policy version {self.version} and at most max_staleness + 1 = {eta + 1} can be that stale "
                f"(generator versions: {dict(self.client.generator_versions)}); is a generator not applying new "
                f"weights, or are the responses empty?")
        await self._finish_evaluation()  # the held line (an earlier step) first
        self._write_metrics(self.step_metrics.record(self.step + 1, self.version, groups, rewards, result,
                                                     trained_version, step_s, wait_s))
        await self._wait_acks()
        self.admission.on_batch_done()
        self._room.notify()

    def _train(self, groups: list[Group], version: int) -> tuple[torch.Tensor, StepResult]:
        """Rewards and one optimizer step (runs in a worker thread). Returns rewards ``[G, n]``."""
        answers = [g.payload.answer if isinstance(g.payload, Prompt) else None for g in groups]
        rewards = torch.tensor([[self.reward_fn(self.tokenizer.decode(s.token_ids), answer) for s in g.samples]
                                for g, answer in zip(groups, answers, strict=True)], dtype=torch.float32)  # [G, n]
        batch = build_batch(groups, rewards, normalize_std=self.config.trainer.normalize_std, fill_version=version)
        tc = self.config.trainer
        base = tc.train_threads or torch.get_num_threads()
        borrow = tc.borrow_threads or 0

        def budget() -> None:  # the generators' idle cores, for the next micro-batch
            torch.set_num_threads(base + borrow if borrow and self.client.generators_idle() else base)

        try:
            return rewards, self.policy.train(batch, version, budget)
        finally:
            torch.set_num_threads(base)

    async def _checkpoint(self) -> None:
        state = TrainerState(step=self.step, policy_version=self.version, prompt_cursor=self.prompts.cursor,
                             untrained=[*self.prompts.retry, *self._untrained.values()],
                             seed=self.config.seed, model=self.config.model.name)
        with self._phase("checkpoint"):
            path = await anyio.to_thread.run_sync(self.policy.save, self.run_dir, state)
        self._last_checkpoint = self.step
        log.info("checkpoint of step %d (policy version %d) written to %s", self.step, self.version, path)


def _progress(metrics: dict[str, object], result: StepResult) -> str:
    """The progress bar's postfix for one step."""
    parts = [f"v{metrics['policy_version']} reward {metrics['reward_mean']:.3f}"]
    if metrics.get("eval_accuracy") is not None:
        parts.append(f"eval {metrics['eval_accuracy']:.3f}")
    if metrics["gen_tokens_per_s"] is not None:
        parts.append(f"{metrics['gen_tokens_per_s']:.0f} tok/s")
    parts.append(f"lag<={result.max_lag} masked {result.tokens_masked_stale}")
    if metrics["acceptance_length"] is not None:
        parts.append(f"accept {metrics['acceptance_length']:.2f}")
    return " ".join(parts)
