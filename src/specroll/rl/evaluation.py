"""Held-out evaluation: one sample per prompt, scored with the task's reward.

The same three pieces serve every evaluator, so accuracies are comparable whoever runs them: the
trainer's in-run evaluation on the generators (``actors/trainer/evaluation.py``), and the
benchmark's evaluation of another trainer's weights loaded into an :class:`~specroll.engine.Engine`
(:func:`evaluate_engine`):

* :func:`eval_sampling`: evaluation prompt ``i`` is decoded with the training sampling settings (or
  greedily) and the fixed seed :func:`eval_seed` ``(i)`` — the engine's sampling is seeded per request,
  whatever else is in the batch, so two evaluations differ only where the weights differ (common
  random numbers: the difference of two accuracies is far less noisy than each);
* :func:`score`: the reward of each response; accuracy = the fraction with reward 1.

The same weights give the same evaluation only up to the batch: in bf16 a token's logits depend on
what else is in the batch (and on the thread count), so two evaluations of one version may differ
by a few prompts; in float32 they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.protocol.sampling import SamplingParams, sample_seed
from specroll.rl.tasks import Prompt, RewardFn

EVAL_SEED_BASE = 0x5EED_E7A1 << 20
"""Seeds of evaluation requests start here (far from the training seeds, which derive from the run
seed and a prompt counter)."""


def eval_seed(index: int) -> int:
    """The sampling seed of evaluation prompt ``index`` (the same in every run and evaluation)."""
    return EVAL_SEED_BASE + index


def eval_sampling(train: SamplingParams, index: int, greedy: bool = False) -> SamplingParams:
    """The sampling of evaluation prompt ``index``: ``train`` (its temperature, top-k/top-p and
    ``max_tokens``), or greedy decoding with ``greedy``, with the fixed seed :func:`eval_seed`."""
    return msgspec.structs.replace(train, seed=eval_seed(index), **({"temperature": 0.0} if greedy else {}))


@dataclass(frozen=True)
class EvalResult:
    """One evaluation pass."""

    accuracy: float
    """Fraction of prompts whose response earned reward 1."""
    reward_mean: float
    response_tokens_mean: float
    prompts: int
    correct: list[str]
    """Prompt ids answered correctly."""


def score(prompts: Sequence[Prompt], responses: Sequence[str], token_counts: Sequence[int],
          reward_fn: RewardFn) -> EvalResult:
    """Score one response per prompt (same order).

    Raises:
        ValueError: no prompts, or the three sequences differ in length.
    """
    if not prompts or not len(prompts) == len(responses) == len(token_counts):
        raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses and {len(token_counts)} token "
                         "counts; expected equal, non-zero")
    rewards = [reward_fn(r, p.answer) for p, r in zip(prompts, responses, strict=True)]
    n = len(prompts)
    return EvalResult(accuracy=sum(r >= 1.0 for r in rewards) / n, reward_mean=sum(rewards) / n,
                      response_tokens_mean=sum(token_counts) / n, prompts=n,
                      correct=[p.prompt_id for p, r in zip(prompts, rewards, strict=True) if r >= 1.0])


def evaluate_engine(engine: Engine, prompts: Sequence[tuple[Prompt, list[int]]], train: SamplingParams,
                    reward_fn: RewardFn, greedy: bool = False) -> EvalResult:
    """Evaluate the weights ``engine`` serves now on ``prompts`` (each with its token ids, chat
    template applied), exactly as the trainer's in-run evaluation does on a generator.

    Raises:
        ValueError: no prompts, or the engine refuses a prompt (too long for its context).
    """
    if not prompts:
        raise ValueError("no evaluation prompts")
    for i, (p, ids) in enumerate(prompts):
        sampling = eval_sampling(train, i, greedy)
        # the seed a generator gives the one sample of this evaluation group
        sampling = msgspec.structs.replace(sampling, seed=sample_seed(eval_seed(i), 0))
        engine.add_request(ids, sampling, request_id=f"eval-{i}-{p.prompt_id}")
    done = run_to_completion(engine)
    completions = [done[f"eval-{i}-{p.prompt_id}"] for i, (p, _) in enumerate(prompts)]
    return score([p for p, _ in prompts], [engine.tokenizer.decode(c.token_ids) for c in completions],
                 [len(c.token_ids) for c in completions], reward_fn)
