"""The trainer's held-out evaluation, run by the generators under one policy version.

Evaluating version v (the weights after step s; s = 0 before training):

1. wait until every connected generator serves v (its acknowledgement), so no evaluation token comes
   from older weights;
2. submit one group of one sample per evaluation prompt in the ``eval`` lane (dispatched before any
   queued training group, never trained on, never sent to the drafter trainer), each decoded with
   :func:`~specroll.rl.evaluation.eval_sampling` — the training sampling (or greedy) and a fixed seed;
3. score the responses (:func:`~specroll.rl.evaluation.score`); a prompt whose group the hub dropped
   (refused or lost past ``trainer.max_group_retries``) is left out, with a warning (``eval_prompts``
   counts the prompts scored).

Meanwhile training goes on; the trainer holds its next publish until the evaluation finished, so every
evaluation token carries version v (checked: ``eval_versions`` in the result).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup

from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.timeline import Timeline
from specroll.actors.trainer.setup import TrainerError
from specroll.engine.loaders.tokenizer import Tokenizer
from specroll.protocol.sampling import SamplingParams
from specroll.rl.evaluation import EvalResult, eval_sampling, score
from specroll.rl.group_retries import GroupDropped
from specroll.rl.tasks import Prompt, RewardFn

log = logging.getLogger("specroll.trainer")


@dataclass(frozen=True)
class Evaluation:
    """A finished evaluation of the weights after ``step`` (policy ``version``)."""

    step: int
    version: int
    result: EvalResult
    versions: tuple[int, int]
    """Lowest and highest policy version of any evaluation token (both ``version`` unless a
    generator could not be brought to it in time)."""
    seconds: float
    """From the evaluation's start (generators asked to serve ``version``) to its score."""

    def metrics(self) -> dict[str, object]:
        """The fields of a metrics line."""
        return {"eval_accuracy": self.result.accuracy, "eval_step": self.step, "eval_policy_version": self.version,
                "eval_reward_mean": self.result.reward_mean,
                "eval_response_tokens_mean": self.result.response_tokens_mean, "eval_prompts": self.result.prompts,
                "eval_versions": list(self.versions), "eval_s": self.seconds}


class Evaluator:
    """Runs one evaluation at a time in the background of the trainer (module docstring).

    Args:
        client: the trainer's client.
        prompts: the evaluation prompts with their token ids (chat template applied).
        sampling: the training sampling settings; ``greedy`` decodes by argmax instead.
        reward_fn, tokenizer: score the decoded responses.
        version_timeout_s: longest wait for the generators to serve the evaluated version.
        check: called about every second while waiting (raises when no generator is left).
        timeline: records an ``evaluation`` event per result.
    """

    def __init__(self, client: RolloutClient, prompts: list[tuple[Prompt, list[int]]], sampling: SamplingParams,
                 greedy: bool, reward_fn: RewardFn, tokenizer: Tokenizer, version_timeout_s: float,
                 check: Callable[[], None], timeline: Timeline | None = None) -> None:
        self.client, self.prompts, self.sampling, self.greedy = client, prompts, sampling, greedy
        self.reward_fn, self.tokenizer = reward_fn, tokenizer
        self.version_timeout_s, self.check, self.timeline = version_timeout_s, check, timeline
        self._done: anyio.Event | None = None
        self._result: Evaluation | None = None

    @property
    def running(self) -> bool:
        return self._done is not None and not self._done.is_set()

    def start(self, tg: TaskGroup, step: int, version: int) -> None:
        """Evaluate ``version`` (the weights after ``step``) in a task of ``tg``; at most one at a time."""
        assert not self.running, "one evaluation at a time"
        self._done, self._result = anyio.Event(), None
        tg.start_soon(self._run, step, version, self._done)

    async def wait(self) -> Evaluation | None:
        """The evaluation started last, once finished (None if none was started since the last wait)."""
        if self._done is None:
            return None
        while not self._done.is_set():
            self.check()
            with anyio.move_on_after(1.0):
                await self._done.wait()
        self._done, result = None, self._result
        return result

    async def _collect(self, version: int) -> tuple[EvalResult, list[int]]:
        """Generate and score: the result and the policy version of every evaluation token."""
        by_id: dict[str, int] = {}
        for i, (prompt, ids) in enumerate(self.prompts):
            group_id = await self.client.submit(ids, 1, eval_sampling(self.sampling, i, self.greedy), payload=prompt,
                                                lane="eval")
            by_id[group_id] = i
        groups, dropped = [], 0
        while len(groups) + dropped < len(by_id):
            try:
                await self.client.wait_finished(1, lane="eval")
            except GroupDropped as e:  # it kept failing (the retry rule): scored without it
                dropped += 1
                log.warning("evaluation of policy version %d goes on without one prompt: %s", version, e)
            groups += self.client.pop_finished(lane="eval")
        if not groups:
            raise TrainerError(f"every one of the {dropped} evaluation prompts was dropped by the retry rule (the "
                               "log's 'dropped' lines say why)")
        groups.sort(key=lambda g: by_id[g.group_id])
        samples = [g.samples[0] for g in groups]
        responses = await anyio.to_thread.run_sync(lambda: [self.tokenizer.decode(s.token_ids) for s in samples])
        prompts = [self.prompts[by_id[g.group_id]][0] for g in groups]
        result = score(prompts, responses, [len(s.token_ids) for s in samples], self.reward_fn)
        return result, [v for s in samples for v in s.versions]

    async def _run(self, step: int, version: int, done: anyio.Event) -> None:
        start = anyio.current_time()
        try:
            await self.client.wait_for_version(version, timeout=self.version_timeout_s)
        except TimeoutError:
            log.warning("evaluating policy version %d although not every generator serves it yet: %s", version,
                        self.client.generator_versions)
        result, versions = await self._collect(version)
        versions = versions or [version]
        self._result = Evaluation(step, version, result, (min(versions), max(versions)),
                                  anyio.current_time() - start)
        if min(versions) != version or max(versions) != version:
            log.warning("evaluation of policy version %d used tokens of versions %d..%d", version, min(versions),
                        max(versions))
        log.info("evaluation after step %d (policy version %d): accuracy %.3f on %d held-out prompts", step, version,
                 result.accuracy, result.prompts)
        if self.timeline is not None:
            self.timeline.record("evaluation", step=step, policy_version=version, accuracy=result.accuracy,
                                 prompts=result.prompts)
        done.set()
