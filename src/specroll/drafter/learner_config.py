"""The drafter learner's settings: a plain struct without torch, so a run config can build one
(``DrafterConfig.learner_config``) without loading the learner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LearnerConfig:
    """Training settings of a :class:`DrafterLearner`.

    Raises:
        ValueError: on construction, naming the field, when a value is out of range.
    """

    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    batch: int = 4
    """Windows per optimizer step."""
    window: int = 128
    """Tokens per window (a window ends in the response); at least ``ttt_steps + 2``."""
    ttt_steps: int = 3
    """Unrolled draft steps of the training-time-test loss."""
    hidden_weight: float = 0.0
    """Weight of the optional hidden-state regression (:func:`ttt_loss`); 0: soft CE only."""
    objective: str = "kl"
    """Each unrolled step's distribution term (:func:`ttt_loss`): ``kl`` (soft cross-entropy, as
    EAGLE-3), ``tv`` (total variation: one minus a sampled draft's acceptance probability) or ``kl+tv``."""
    buffer_rollouts: int = 512
    """Replay buffer capacity in rollouts (oldest dropped first): the recent RL steps."""
    min_rollouts: int = 8
    """Rollouts needed before the first step (cold start builds the head from them)."""
    max_context: int = 1024
    """Tokens of a rollout whose features are computed (a longer one is cut at the end)."""
    draft_vocab_size: int = 4096
    """Draft vocabulary of a cold-started head (capped at the target's vocabulary)."""
    features: str = "eagle3"
    """Taps of a cold-started head: ``eagle3`` (low/mid/high layers) or ``last`` (EAGLE-1)."""
    seed: int = 0
    architecture: str = "eagle3"
    """Architecture of a cold-started head (``EagleConfig.architecture``): ``eagle3`` (EAGLE-3's
    midlayer and own LM head, initialised from the target's) or ``eagle``."""

    def __post_init__(self) -> None:
        for name in ("batch", "window", "ttt_steps", "buffer_rollouts", "min_rollouts", "max_context",
                     "draft_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"drafter {name}={getattr(self, name)}, expected a positive integer")
        if self.window < self.ttt_steps + 2:  # step i of the unrolled loss predicts x_{t+2+i}
            raise ValueError(f"drafter window={self.window}, expected at least ttt_steps + 2 = {self.ttt_steps + 2} "
                             f"tokens (ttt_steps={self.ttt_steps}; the first draft predicts x_(t+2))")
        if self.hidden_weight < 0:
            raise ValueError(f"drafter hidden_weight={self.hidden_weight}, expected >= 0")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"drafter lr={self.lr}, weight_decay={self.weight_decay}: expected lr > 0 and "
                             "weight_decay >= 0")
        if self.objective not in ("kl", "tv", "kl+tv"):
            raise ValueError(f"drafter objective={self.objective!r}, expected 'kl', 'tv' or 'kl+tv'")
        if self.features not in ("eagle3", "last"):
            raise ValueError(f"drafter features={self.features!r}, expected 'eagle3' or 'last'")
        if self.architecture not in ("eagle3", "eagle"):
            raise ValueError(f"drafter architecture={self.architecture!r}, expected 'eagle3' or 'eagle'")
