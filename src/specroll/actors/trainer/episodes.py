"""Episodes in the trainer: an environment (``specroll.envs``) runs each episode against the
server in the trainer's own process, and the turns the server recorded are what the step trains.

Per episode (:meth:`EpisodeRunner.episode`): open a fresh ``X-Session-ID`` in the server's episode
log, call the environment with an ``openai.AsyncOpenAI`` client that sends it (so each turn's prompt
is stitched from the tokens before it, ``actors/server/stitch.py``), take its reward, close the
session and keep its turns. It fails — an exception of the environment, more than
``task.episode_timeout_s`` seconds, more than ``task.max_turns`` turns, no turn at all, a reward that
is not a finite number — and then runs again from the start with a new seed while its group's
failures number at most ``trainer.max_group_retries`` (the retry rule of every group,
``specroll/rl/group_retries.py``); one failure more drops the whole group, its other episodes
cancelled (a group is never trained partial: its advantages would be normalised over the episodes
that happened to succeed, a bias towards whatever fails less), and the feeder counts it
(``group_drops.py``).

:class:`EpisodeFeeder` is :class:`~specroll.actors.trainer.feeder.Feeder`'s counterpart: the same
admission (``rl/admission.py``), a group being n episodes of one prompt run concurrently; its
groups run as tasks of the feeder's task group, so in synchronous mode too.
"""

from __future__ import annotations

import functools
import logging
import math
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
from anyio.abc import TaskGroup

from specroll.actors.config import RunConfig
from specroll.actors.server.state import ServerState
from specroll.actors.shared.wakeup import Wakeup
from specroll.actors.trainer.generator_watch import GeneratorWatch
from specroll.actors.trainer.group_drops import GroupDrops
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.envs.base import Environment, EpisodeOutcome, EpisodePrompt
from specroll.protocol.sampling import SamplingParams
from specroll.rl.admission import Admission, run_ahead_warning
from specroll.rl.episodes import Episode, EpisodeGroup
from specroll.rl.group_retries import GroupRetries
from specroll.rl.tasks import Prompt

log = logging.getLogger("specroll.trainer")


class EpisodeFailed(RuntimeError):
    """An episode ended without a trainable result (the message says why)."""


class _GroupFailed(Exception):
    pass


def sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """``generator.sampling`` as keyword arguments of ``chat.completions.create`` (``top_k`` through
    ``extra_body``, the server's vLLM extension)."""
    out: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                           "max_tokens": sampling.max_tokens}
    if sampling.top_k > 0:
        out["extra_body"] = {"top_k": sampling.top_k}
    return out


def episode_seed(group_seed: int, index: int, attempt: int) -> int:
    """The seed of episode ``index`` of a group, try ``attempt`` (0 first): the sampling seed of
    each of its requests and the environment's own."""
    return (group_seed * 1_000_003 + index * 1009 + attempt) & (2**63 - 1)


class EpisodeRunner:
    """Runs episodes of an environment against the server in this process (module docstring).

    Args:
        config: the run (``[task]``: timeout, turns; ``trainer.max_group_retries``; ``[server]``: the key).
        server: the server's state (its episode log and transcripts).
        url: its base URL (``http://HOST:PORT/v1``).
        environment: the environment.
    """

    def __init__(self, config: RunConfig, server: ServerState, url: str, environment: Environment) -> None:
        task = config.task
        self.environment, self.server, self.model = environment, server, server.model_name
        self.timeout_s, self.max_turns = task.episode_timeout_s, task.max_turns
        self.max_group_retries = config.trainer.max_group_retries
        import openai  # the agentic extra: imported by runs with an environment only

        self.api = openai.AsyncOpenAI(base_url=url, api_key=config.server.api_key or "unused", max_retries=0,
                                      timeout=config.server.request_timeout_s + 30)
        self.failures: Counter[str] = Counter()
        """Failed episodes by reason, over the run."""
        self.last_failure = ""
        """What the last failed episode said."""

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.api.close()

    async def episode(self, prompt: Prompt, seed: int, sampling: Mapping[str, Any],
                      evaluation: bool = False) -> Episode:
        """Run one episode of ``prompt``.

        Raises:
            EpisodeFailed: the environment raised, timed out, returned no finite reward, took more
                than ``task.max_turns`` turns or none.
        """
        session = f"episode-{uuid.uuid4().hex}"
        log_ = self.server.router.episodes
        log_.open(session, self.max_turns)  # a request past it is refused: an episode's work is bounded
        start = anyio.current_time()
        client = self.api.with_options(default_headers={"X-Session-ID": session})
        try:
            with anyio.fail_after(self.timeout_s):
                result = await self.environment(client, EpisodePrompt(
                    prompt, self.model, {**sampling, "seed": seed}, seed, evaluation,
                    functools.partial(log_.attach, session)))
        except TimeoutError:
            raise EpisodeFailed(f"timeout: over task.episode_timeout_s = {self.timeout_s:g} s") from None
        except Exception as e:
            raise EpisodeFailed(f"environment error: {type(e).__name__}: {str(e)[:300]}") from e
        finally:
            turns, overflowed, attached = log_.close(session)
            for ended in (session, *attached):  # their last turns are never continued
                self.server.router.transcripts.forget(ended)
        outcome = result if isinstance(result, EpisodeOutcome) else EpisodeOutcome(result)  # type: ignore[arg-type]
        if isinstance(outcome.reward, bool) or not isinstance(outcome.reward, int | float) \
                or not math.isfinite(outcome.reward):
            raise EpisodeFailed(f"bad reward: the environment returned {outcome.reward!r}, expected a finite number")
        if overflowed or len(turns) > self.max_turns:
            raise EpisodeFailed(f"too many turns: over task.max_turns = {self.max_turns}")  # attached sessions
        if not turns:
            raise EpisodeFailed("no turn: the environment made no request through its client")
        metrics = {k: float(v) for k, v in outcome.metrics.items() if isinstance(v, int | float)}
        return Episode(turns, float(outcome.reward), metrics, anyio.current_time() - start)

    async def group(self, group_id: str, prompt: Prompt, n: int, seed: int,
                    sampling: Mapping[str, Any]) -> EpisodeGroup | None:
        """n episodes of ``prompt`` at once under the retry rule (:func:`run_group`); None: the
        group dropped."""

        def failed(e: EpisodeFailed) -> None:
            self.failures[str(e).partition(":")[0]] += 1
            self.last_failure = str(e)

        retries = GroupRetries(self.max_group_retries)
        ran = await run_group(lambda s: self.episode(prompt, s, sampling), group_id, n, seed, retries, failed)
        return None if ran is None else EpisodeGroup(group_id, prompt, ran, retries.failures)


async def run_group(episode: Callable[[int], Awaitable[Episode]], group_id: str, n: int, seed: int,
                    retries: GroupRetries, failed: Callable[[EpisodeFailed], None] = lambda e: None,
                    ) -> list[Episode] | None:
    """Run ``n`` episodes at once, ``episode(seed)`` each, every failed one run again with its next
    seed (:func:`episode_seed`) while the group's failures number at most ``retries.limit``
    (``specroll/rl/group_retries.py``); past that the others are cancelled and the group dropped.

    Args:
        episode: runs one episode from its seed; raises :class:`EpisodeFailed`.
        group_id: for the log lines.
        n: episodes in the group.
        seed: the group's seed.
        retries: the group's failures against the rule (counted here: ``retries.failures`` after
            the run is the retries its episodes took).
        failed: told of every failure.

    Returns:
        The ``n`` episodes in order, or None: the group dropped.
    """
    episodes: list[Episode | None] = [None] * n

    async def slot(i: int) -> None:
        attempt = 0
        while True:
            try:
                episodes[i] = await episode(episode_seed(seed, i, attempt))
                return
            except EpisodeFailed as e:
                failed(e)
                again = retries.fail("failed", str(e))
                log.warning("group %s episode %d (attempt %d) failed, failure %d of the group (at most %d "
                            "retried): %s", group_id, i, attempt + 1, retries.failures, retries.limit, e)
                if not again:
                    raise _GroupFailed from None
                attempt += 1

    dropped = False
    try:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(slot, i)
    except* _GroupFailed:
        dropped = True  # the other episodes were cancelled
    return None if dropped else [e for e in episodes if e is not None]


class EpisodeFeeder:
    """Starts the run's episode groups and takes finished batches (module docstring); the interface
    of :class:`~specroll.actors.trainer.feeder.Feeder`.

    Args:
        config: the run.
        runner: runs the episodes.
        prompts: the prompt order.
        watch: raises while waiting once no generator is left.
    """

    def __init__(self, config: RunConfig, runner: EpisodeRunner, prompts: PromptCycle, watch: GeneratorWatch) -> None:
        self.config, self.runner, self.prompts, self.watch = config, runner, prompts, watch
        tc = config.trainer
        self.admission = Admission(tc.batch_groups, tc.max_staleness, tc.max_groups_in_flight)
        self.sampling = sampling_kwargs(config.generator.sampling)
        self.untrained: dict[str, int] = {}
        """Groups started and not yet trained: group id → its position in the prompt order."""
        self.finished: deque[EpisodeGroup] = deque()
        self.running = 0
        self.drops = GroupDrops(config, prompts, self.admission, self.untrained)
        """Groups dropped (an episode failed past ``trainer.max_group_retries``): logged, counted, their
        prompts skipped or served again."""
        self._room, self._changed = Wakeup(), Wakeup()
        self._tg: TaskGroup | None = None
        self._count = 0

    async def run(self, submit: bool = True) -> None:
        """Host the groups' tasks until cancelled; with ``submit`` (off-step), start groups while
        :class:`Admission` has room."""
        tc = self.config.trainer
        if submit and (warning := run_ahead_warning(tc.max_groups_in_flight, tc.batch_groups, tc.max_staleness)):
            log.warning("%s", warning)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._changed.notify()
            while True:
                while submit and self.admission.room(self.running + len(self.finished)) > 0:
                    self._start_next()
                await self._room.wait()

    async def submit_batch(self) -> None:
        """Sync mode: start one step's groups."""
        while self._tg is None:
            await self._changed.wait()
        for _ in range(self.config.trainer.batch_groups):
            self._start_next()

    async def wait_for_batch(self) -> list[EpisodeGroup]:
        """The ``batch_groups`` oldest finished groups, once there are that many.

        Raises:
            TrainerError: no generator connected for too long (:class:`GeneratorWatch`).
        """
        batch = self.config.trainer.batch_groups
        while len(self.finished) < batch:
            self.watch.check()
            with anyio.move_on_after(self.watch.check_s):
                await self._changed.wait()
        groups = [self.finished.popleft() for _ in range(batch)]
        self._room.notify()
        return groups

    def batch_done(self) -> None:
        """A step took its batch and finished: room for B more."""
        self.admission.on_batch_done()
        self._room.notify()

    def _start_next(self) -> None:
        assert self._tg is not None
        draw = self.prompts.next()
        self._count += 1
        group_id = f"episodes-{self._count}-{draw.position}"
        self.untrained[group_id] = draw.position
        self.admission.on_submit()
        self.running += 1
        self._tg.start_soon(self._run_group, group_id, draw.prompt, draw.seed, draw.position)

    async def _run_group(self, group_id: str, prompt: Prompt, seed: int, position: int) -> None:
        try:
            group = await self.runner.group(group_id, prompt, self.config.trainer.group_size, seed, self.sampling)
        finally:
            self.running -= 1
        if group is None:
            self.drops.drop(group_id, prompt.prompt_id, "failed", self.runner.last_failure, by_hub=False)
            if self.config.trainer.mode == "sync":
                self._start_next()  # the step still needs its batch
        else:
            self.drops.finished()
            self.finished.append(group)
        self._changed.notify()
        self._room.notify()
