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
3. a feeder task submits groups while ``trainer.max_groups_in_flight`` and the staleness bound
   leave room (``feeder.py``);
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

Beside this module: its start (policy, optimizer, prompts, restore) in ``setup.py``, the feeder
and the wait for a batch in ``feeder.py``, the prompt order in ``prompt_cycle.py``, giving up
without generators in ``generator_watch.py``, the threads of a step in ``thread_budget.py``, the
metrics records and lines in ``metrics.py``, checkpoints in ``checkpoint.py``, the process around
it (bind, the endpoint file, exit codes) in ``process.py``, the command line in ``cli.py``; the GRPO
maths in ``specroll/rl/`` (``grpo.py``, ``grpo_step.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import torch
from anyio.abc import TaskGroup
from tqdm import tqdm

from specroll.actors.config import RunConfig
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.timeline import Timeline
from specroll.actors.trainer.checkpoint import TrainerState
from specroll.actors.trainer.checkpoint_schedule import CheckpointSchedule
from specroll.actors.trainer.episode_eval import EpisodeEvaluator
from specroll.actors.trainer.episode_metrics import episode_metrics, token_versions
from specroll.actors.trainer.episodes import EpisodeFeeder, EpisodeRunner, sampling_kwargs
from specroll.actors.trainer.evaluation import Evaluator
from specroll.actors.trainer.feeder import Feeder
from specroll.actors.trainer.generator_watch import GeneratorWatch
from specroll.actors.trainer.metrics import (
    METRICS_FILENAME,
    RecordLog,
    StepMetrics,
    earlier_incarnation,
    progress,
    truncate_metrics,
)
from specroll.actors.trainer.setup import TrainerError, TrainerSetup
from specroll.actors.trainer.thread_budget import thread_budget
from specroll.rl.coordinator import Group
from specroll.rl.episodes import EpisodeGroup, pack_episode_groups
from specroll.rl.grpo_step import StepResult, build_batch
from specroll.rl.tasks import Prompt, RewardFn, get_reward

log = logging.getLogger("specroll.trainer")


# ---- the actor ----------------------------------------------------------------------------------


class Trainer:
    """Drives one run: feeds groups, trains on finished ones, publishes versions (module docstring).

    Args:
        config: the run.
        setup: the loaded policy, optimizer, prompts and restored state.
        client: a started client generators connect to.
    """

    def __init__(self, config: RunConfig, setup: TrainerSetup, client: RolloutClient,
                 timeline: Timeline | None = None, runner: EpisodeRunner | None = None) -> None:
        self.config, self.client, self.timeline = config, client, timeline
        self.policy, self.tokenizer = setup.policy, setup.tokenizer
        self.prompts = setup.prompts
        self.step, self.version = setup.state.step, setup.state.policy_version
        self.resumed_from, self.refused = setup.resumed_from, setup.refused
        self.reward_fn: RewardFn = get_reward(config.task.reward)
        self.run_dir = Path(config.run_dir)
        self.watch = GeneratorWatch(client, config.network.heartbeat_timeout_s)
        """Gives up once no generator has been connected for a while."""
        self.runner = runner
        """Runs the episodes of an episode task (``task.environment``); None: single-turn groups."""
        self.feeder: Feeder | EpisodeFeeder = (EpisodeFeeder(config, runner, self.prompts, self.watch) if runner
                                               else Feeder(config, client, self.prompts, self.watch))
        """Submits the training groups (or runs the episode groups) and takes finished batches."""
        self._skipped_in_row = 0
        """Batches in a row with no token to train (``_skip``)."""
        self.step_metrics = StepMetrics(client, config.drafter.acceptance_floor, self.feeder.drops)
        self.records = RecordLog.open(config, client, self.step, self.feeder.drops)  # metrics.jsonl, /metrics, sinks
        self.checkpoints = CheckpointSchedule(config, self.step, self.resumed_from, self.refused)
        evaluator = dict(client=client, prompts=setup.eval_prompts, sampling=config.generator.sampling,
                         greedy=config.eval.greedy, reward_fn=self.reward_fn, tokenizer=self.tokenizer,
                         version_timeout_s=config.network.heartbeat_timeout_s, check=self.watch.check,
                         timeline=timeline)
        self.evaluator = None if not setup.eval_prompts else (
            EpisodeEvaluator(runner, sampling_kwargs(config.generator.sampling), **evaluator) if runner
            else Evaluator(**evaluator))  # type: ignore[arg-type]
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
            log.log(logging.WARNING if self.refused else logging.INFO, "resuming from %s: step %d, policy version %d%s",
                    self.resumed_from, self.step, self.version, "".join(f"; refused {e}" for e in self.refused))
            if self.step >= self.config.steps:
                log.info("the checkpoint is already at step %d of %d: nothing to train", self.step, self.config.steps)
                return
        elif earlier_incarnation(self.run_dir):  # killed before its first checkpoint: it may have published versions
            log.info("an earlier trainer of this run left no checkpoint in %s: starting again from step 0",
                     self.run_dir)
            resume = True
        if resume:
            await self._publish_after_resume()
            held = truncate_metrics(self.run_dir / METRICS_FILENAME, self.step, self._evaluates(self.step))
        sync = self.config.trainer.mode == "sync"
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if isinstance(self.feeder, EpisodeFeeder):  # hosts the episode groups in either mode
                tg.start_soon(self.feeder.run, not sync)
            elif not sync:
                tg.start_soon(self._feed)
            if self._maybe_evaluate():  # the weights before the first step: a line of their own
                # (resumed: the step's old line, its evaluation to be replaced by this one's)
                self._held = held or {"step": self.step, "policy_version": self.version, "time": time.time()}
            # disable=None: no bar when stderr is a log file (the launcher prints a line per step instead)
            with tqdm(total=self.config.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                      file=sys.stderr, disable=None) as bar:
                while self.step < self.config.steps:
                    await self._one_step(bar, sync)
            if self.checkpoints.final_due(self.step):
                await self._checkpoint(final=True)
            tg.cancel_scope.cancel()

    async def _feed(self) -> None:
        """The feeder task (:meth:`Feeder.run`)."""
        assert isinstance(self.feeder, Feeder)
        await self.feeder.run()

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
            self.records.export.on_phase(phase, time.time() - start, self.version)
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
        self.records.append(held)

    async def _publish_after_resume(self) -> None:
        """Publish the restored (or, with no checkpoint, initial) weights above every version a
        generator may serve (timeline step 2)."""
        await self.watch.wait_for_one()
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

    async def _overtake(self, groups: Sequence[Group | EpisodeGroup]) -> None:
        """A generator or a rollout token reports a version above ours (an earlier incarnation of this
        trainer published it): republish the current weights above it, so versions only increase."""
        tokens = max((v for g in groups for v in token_versions(g)), default=-1)
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
                await self.feeder.submit_batch()
            groups = await self.feeder.wait_for_batch()
        # in the order they were submitted, not finished: a seeded sync run trains the same batch
        # (same rows, same ranks, same float sums) whatever order its rollouts happened to finish in
        groups.sort(key=lambda g: self.feeder.untrained.get(g.group_id, math.inf))
        start = time.monotonic()
        await self._overtake(groups)
        trained_version = self.version
        positions = [self.feeder.untrained.pop(g.group_id, None) for g in groups]
        if self.timeline is not None:
            resumed = [g for g in groups if isinstance(g, Group) and g.dispatches > 1]
            self.timeline.record("step_groups", step=self.step + 1, group_ids=[g.group_id for g in groups],
                                 prompt_ids=[g.payload.prompt_id for g in groups if isinstance(g.payload, Prompt)],
                                 positions=positions, resumed=[g.group_id for g in resumed],
                                 resumed_tokens={g.group_id: [smp.token_ids for smp in g.samples] for g in resumed})
        pause = self.config.drafter.pause_during_train_step
        if pause:
            self.client.pause_drafter(True)
        try:
            with self._phase("train"):
                train_start = time.monotonic()
                rewards, result, borrowed = await anyio.to_thread.run_sync(self._train, groups, trained_version)
                train_s = time.monotonic() - train_start
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
        self.feeder.batch_done()  # sampled after this publish: room for B more (rl/admission.py)
        if sync or self.step == self.config.steps:
            with self._phase("publish"):
                await self._wait_acks()
        metrics = self.step_metrics.record(self.step, self.version, groups, rewards, result, trained_version,
                                           time.monotonic() - start, start - wait_start, train_s, borrowed)
        self.checkpoints.add_warning(metrics)  # of a checkpoint a full disk stopped: specroll launch prints it
        if isinstance(self.feeder, EpisodeFeeder):
            metrics.update(episode_metrics(groups, self.feeder))  # type: ignore[arg-type]
        if self._maybe_evaluate():
            self._held = metrics
        else:
            self.records.append(metrics)
        if self.step == self.config.steps:
            await self._finish_evaluation()
        bar.set_postfix_str(progress(metrics, result), refresh=False)
        bar.update(1)
        if self.checkpoints.due(self.step):
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
        if self._skipped_in_row > self.feeder.admission.max_skipped_in_row:
            raise TrainerError(
                f"{self._skipped_in_row} batches in a row had no token to train, although every generator was "
                f"sent policy version {self.version} and at most max_staleness + 1 = {eta + 1} can be that stale "
                f"(generator versions: {dict(self.client.generator_versions)}); is a generator not applying new "
                f"weights, or are the responses empty?")
        await self._finish_evaluation()  # the held line (an earlier step) first
        self.records.append(self.step_metrics.record(self.step + 1, self.version, groups, rewards, result,
                                                             trained_version, step_s, wait_s))
        await self._wait_acks()
        self.feeder.batch_done()

    def _train(self, groups: list[Group] | list[EpisodeGroup], version: int
               ) -> tuple[torch.Tensor, StepResult, float | None]:
        """Rewards and one optimizer step (runs in a worker thread). Returns rewards ``[G, n]``, the
        step's result and the share of its phases that borrowed the generators' threads."""
        normalize = self.config.trainer.normalize_std
        if groups and isinstance(groups[0], EpisodeGroup):  # rewards from the environment
            rewards, batch = pack_episode_groups(groups, normalize_std=normalize, fill_version=version)
        else:
            answers = [g.payload.answer if isinstance(g.payload, Prompt) else None for g in groups]
            rewards = torch.tensor([[self.reward_fn(self.tokenizer.decode(s.token_ids), answer) for s in g.samples]
                                    for g, answer in zip(groups, answers, strict=True)], dtype=torch.float32)  # [G, n]
            batch = build_batch(groups, rewards, normalize_std=normalize, fill_version=version)
        tc = self.config.trainer
        with thread_budget(tc.train_threads, tc.borrow_threads, self.client.generators_idle) as budget:
            result = self.policy.train(batch, version, budget)
        return rewards, result, budget.borrowed_fraction

    async def _checkpoint(self, final: bool = False) -> None:
        state = TrainerState(step=self.step, policy_version=self.version, prompt_cursor=self.prompts.cursor,
                             untrained=[*self.prompts.retry, *self.feeder.untrained.values()],
                             seed=self.config.seed, model=self.config.model.name)
        with self._phase("checkpoint"):
            await anyio.to_thread.run_sync(self.checkpoints.write, self.policy.save, self.run_dir, state, final)
