"""Held-out evaluation of an episode task: one episode per evaluation prompt, run by the task's
environment against the server under the evaluated policy version (``evaluation.py``'s timeline:
the generators serve the version first, the trainer holds its next publish until it finished).

Each episode samples with the training settings (or greedily, ``eval.greedy``) and the fixed seed
of its prompt (``rl/evaluation.eval_seed``), so two evaluations differ where the weights do. An
episode that fails (``episodes.EpisodeFailed``, after no retry) scores 0 and is counted.
"""

from __future__ import annotations

import logging

import anyio

from specroll.actors.trainer.episodes import EpisodeFailed, EpisodeRunner
from specroll.actors.trainer.evaluation import Evaluator
from specroll.rl.episodes import Episode
from specroll.rl.evaluation import EvalResult, eval_seed

log = logging.getLogger("specroll.trainer")


class EpisodeEvaluator(Evaluator):
    """:class:`Evaluator` whose responses are episodes of ``runner``'s environment.

    Args:
        runner: runs the episodes; ``request_sampling``: the training sampling as request arguments.
        Others: as :class:`Evaluator` (``reward_fn`` and ``tokenizer`` unused: the environment scores).
    """

    def __init__(self, runner: EpisodeRunner, request_sampling: dict, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.runner, self.request_sampling = runner, request_sampling
        self.failed = 0
        """Evaluation episodes that failed (scored 0), over the run."""

    async def _collect(self, version: int) -> tuple[EvalResult, list[int]]:
        results: list[Episode | None] = [None] * len(self.prompts)
        sampling = {**self.request_sampling, **({"temperature": 0.0} if self.greedy else {})}

        async def one(i: int) -> None:
            try:
                results[i] = await self.runner.episode(self.prompts[i][0], eval_seed(i), sampling, evaluation=True)
            except EpisodeFailed as e:
                self.failed += 1
                log.warning("evaluation episode of prompt %s failed (scored 0): %s", self.prompts[i][0].prompt_id, e)

        async with anyio.create_task_group() as tg:
            for i in range(len(self.prompts)):
                tg.start_soon(one, i)
        rewards = [e.reward if e is not None else 0.0 for e in results]
        tokens = [sum(len(t.token_ids) for t in e.turns) if e is not None else 0 for e in results]
        correct = [p.prompt_id for (p, _), r in zip(self.prompts, rewards, strict=True) if r >= 1.0]
        count = max(len(rewards), 1)
        result = EvalResult(accuracy=len(correct) / count, reward_mean=sum(rewards) / count,
                            response_tokens_mean=sum(tokens) / count, prompts=len(rewards), correct=correct)
        return result, [v for e in results if e is not None for t in e.turns for v in t.versions]
