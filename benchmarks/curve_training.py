"""``bench_drafter_curve.py``'s training: the head variants and the drafter learner run offline on
cached rollouts to a budget of CPU time, stopping at each checkpoint.

The budget is **CPU time** of the training loop: ``time.process_time()`` deltas around each
``DrafterLearner.step()``, which count every torch thread, so a 2-thread step costs about twice
its wall time ("CPU-minutes"), and another process on a shared machine does not eat into it.

The learner computes a rollout's target features (its taps and final hidden states, cached in
bfloat16) the first time a step draws it. Every variant trains on the same rollouts with the same
taps, so :func:`shared_features` computes them once, before any budget starts, and every variant's
learner reads that one cache; the learner has no public hook for it, so it reaches into the
learner's buffer (``_buffer``, ``_refresh``). That one-time cost (about 2.6 ms of CPU per token in
float32 here) is reported apart.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from specroll.drafter.learner import DrafterLearner, LearnerConfig
    from specroll.drafter.ttt import Rollout
    from specroll.engine.model import CausalLM

Objective = Literal["kl", "tv", "kl+tv"]


@dataclass(frozen=True)
class Variant:
    """One head to train: its architecture, draft vocabulary and loss."""

    name: str
    architecture: Literal["eagle3", "eagle"]
    full_vocab: bool
    """Draft vocabulary = the target's whole vocabulary (else ``--draft-vocab-size`` most frequent tokens)."""
    objective: Objective
    """``LearnerConfig.objective``: ``kl`` soft cross-entropy (EAGLE-3's), ``tv`` total variation
    (one minus a sampled draft's acceptance probability), ``kl+tv`` their sum."""
    about: str


VARIANTS = {v.name: v for v in (
    Variant("eagle3", "eagle3", False, "kl", "EAGLE-3 head, top-N draft vocabulary, soft CE (specroll's default)"),
    Variant("eagle", "eagle", False, "kl",
            "EAGLE-1 style head (fc + decoder layer, the target's frozen LM head), EAGLE-3 taps, top-N vocabulary"),
    Variant("eagle3-fullvocab", "eagle3", True, "kl", "EAGLE-3 head over the target's whole vocabulary, soft CE"),
    Variant("eagle3-tv", "eagle3", False, "tv", "EAGLE-3 head, top-N vocabulary, total-variation objective"),
    Variant("eagle3-kltv", "eagle3", False, "kl+tv", "EAGLE-3 head, top-N vocabulary, soft CE + TV"),
)}
MAIN_VARIANT = "eagle3"
"""The variant trained to the last checkpoint; the others stop at ``--max-minutes-other``."""


def learner_config(variant: Variant, base: LearnerConfig, vocab_size: int) -> LearnerConfig:
    """``base`` (the shared training settings) with ``variant``'s architecture, vocabulary and loss."""
    size = vocab_size if variant.full_vocab else base.draft_vocab_size
    return replace(base, architecture=variant.architecture, draft_vocab_size=size, objective=variant.objective)


def new_learner(target: CausalLM, config: LearnerConfig, rollouts: list[Rollout], eos: list[int],
                features: deque | None = None) -> DrafterLearner:
    """A learner holding ``rollouts`` (their token counts pick the cold-started head's draft
    vocabulary at the first step); with ``features`` (:func:`shared_features`), it trains on that cache."""
    from specroll.drafter.learner import DrafterLearner

    learner = DrafterLearner(target, replace(config, buffer_rollouts=len(rollouts), min_rollouts=1),
                             eos_token_ids=eos)
    for r in rollouts:
        learner.add_rollout(r.token_ids, r.prompt_len, r.policy_version)
    if features is not None:
        assert len(features) == len(rollouts), "the cache holds these rollouts"
        learner._buffer = features  # the same rollouts, their features already computed
    return learner


def shared_features(target: CausalLM, config: LearnerConfig, rollouts: list[Rollout],
                    eos: list[int]) -> tuple[deque, float]:
    """Every rollout's target features for ``config``'s taps, computed as the learner computes them
    (module docstring); returns the learner's buffer to share and the CPU seconds it took."""
    learner = new_learner(target, config, rollouts, eos)
    head = learner._cold_start_head()  # only its taps are read
    start = time.process_time()
    learner._refresh(list(learner._buffer), head)
    return learner._buffer, time.process_time() - start


@dataclass
class Mark:
    """Where training stood at a checkpoint."""

    cpu_minutes: float
    """CPU time spent in learner steps (both threads)."""
    wall_minutes: float
    """Wall time of those steps."""
    steps: int
    train: dict[str, float]
    """The learner's metrics (``ttt_loss``'s, on training windows) averaged over the steps since the last mark."""


@dataclass
class BudgetedTraining:
    """A learner stepped until its CPU time reaches each checkpoint in turn."""

    learner: DrafterLearner
    cpu_s: float = 0.0
    wall_s: float = 0.0
    _pending: list[dict[str, float]] = field(default_factory=list)

    def run_to(self, cpu_minutes: float) -> Mark:
        """Step until ``cpu_minutes`` of CPU have gone into learner steps (the last step may overshoot)."""
        while self.cpu_s < cpu_minutes * 60:
            cpu, wall = time.process_time(), time.perf_counter()
            self._pending.append(self.learner.step())
            self.cpu_s += time.process_time() - cpu
            self.wall_s += time.perf_counter() - wall
        keys = [k for k in self._pending[0] if k != "step"] if self._pending else []
        train = {k: sum(m[k] for m in self._pending) / len(self._pending) for k in keys}
        self._pending = []
        return Mark(self.cpu_s / 60, self.wall_s / 60, self.learner.steps, train)
