"""``[drafter]``: the drafter trainer — online training of an EAGLE-style drafter on the rollouts,
its warm start, schedule and publishing; the drafter layer's own
:class:`~specroll.drafter.learner_config.LearnerConfig` is built from it."""

from __future__ import annotations

import math
from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_count as _require_count
from specroll.actors.config.section import require_seconds as _require_seconds
from specroll.drafter.learner_config import LearnerConfig
from specroll.engine.config import MAX_DRAFT_TOKENS, MAX_NUM_THREADS
from specroll.protocol.limits import MAX_SEQUENCE_TOKENS

MAX_WARM_START_ROLLOUTS = 100_000
"""The most responses a warm start generates (``warm_start_rollouts``, ``drafter init --rollouts``):
hours of generation on a CPU; a bound so that no setting asks for unbounded work."""
MAX_KV_CACHE_GB = 1024.0
"""The most GiB of drafter K/V a generator may be asked to allocate (``kv_cache_gb``)."""
_COUNTS = {"window_rollouts": 1_000_000, "publish_every_steps": 1_000_000, "batch": 4096,
           "window_tokens": MAX_SEQUENCE_TOKENS, "ttt_steps": MAX_DRAFT_TOKENS, "min_rollouts": 1_000_000,
           "draft_vocab_size": 1 << 20, "num_threads": MAX_NUM_THREADS}
"""Each count's upper bound (its lower is 1): the replay buffer and a training step's windows are held
in memory, and a draft vocabulary is at most a model's."""


class DrafterConfig(_Section):
    """The drafter trainer: trains an EAGLE-style drafter online on the rollouts (``[drafter]``).

    It learns the current policy from finished rollouts while generators have idle capacity and
    publishes drafter versions, which generators with ``generator.speculative = "eagle"`` (or
    ``"auto"``) hot-swap between steps (``specroll.actors.drafter_trainer.actor``)."""

    enabled: bool = False
    """Start the drafter trainer and publish drafter versions to the generators (with
    ``generator.speculative`` ``off`` or ``suffix`` no generator drafts with them: a warning at start,
    :meth:`RunConfig.warnings`). Default false."""
    path: str | None = None
    """Initial drafter directory (``config.json`` + ``model.safetensors``, as ``specroll init-drafter``
    or ``specroll drafter train`` write): the warm start, served from the first step; ``None``
    (default): cold start, the first version is built from the first rollouts."""
    learning_rate: float = 1e-3
    """AdamW learning rate of the drafter. Default 1e-3."""
    window_rollouts: int = 256
    """Replay buffer: the most recent finished rollouts the drafter trains on, 1 to 1,000,000. Default 256."""
    publish_every_steps: int = 20
    """Drafter training steps between published drafter versions, 1 to 1,000,000. Default 20."""
    batch: int = 4
    """Windows per drafter training step, 1 to 4096. Default 4."""
    window_tokens: int = 128
    """Tokens per training window (ending in the response); at least ``ttt_steps + 2``, as the first
    draft predicts the token two past a window position; at most 1,048,576. Default 128."""
    ttt_steps: int = 3
    """Unrolled draft steps of EAGLE-3's training-time-test loss, 1 to 32. Default 3."""
    hidden_weight: float = 0.0
    """Weight of the optional hidden-state regression (SmoothL1 to the target's final hidden state,
    as TLT adds it); 0 (default, as EAGLE-3) trains on the soft cross-entropy only."""
    objective: Literal["kl", "tv", "kl+tv"] = "kl"
    """Each unrolled step's training term: ``kl`` (soft cross-entropy, as EAGLE-3; default), ``tv``
    (total variation, one minus a sampled draft's acceptance probability; DistillSpec) or ``kl+tv``."""
    min_rollouts: int = 8
    """Rollouts needed before a cold start's first step; at most ``window_rollouts``. Default 8."""
    draft_vocab_size: int = 4096
    """Draft vocabulary of a cold-started drafter (the rollouts' most frequent tokens); at most the
    model's vocabulary (``specroll launch`` and ``specroll drafter serve`` refuse more). Default 4096."""
    features: Literal["eagle3", "last"] = "eagle3"
    """Target taps of a cold-started drafter: ``eagle3`` (low, mid, high layers; default) or ``last``."""
    architecture: Literal["eagle3", "eagle"] = "eagle3"
    """Architecture of a cold-started drafter: ``eagle3`` (EAGLE-3's head with its own LM head, as vLLM
    and SGLang run it; default) or ``eagle`` (fc then a decoder layer, the policy's LM head). A warm
    start (``path``, or the run's saved drafter) keeps its own."""
    num_threads: int = 1
    """Core budget: torch intra-op threads of the drafter trainer. Default 1."""
    duty_cycle: float = 0.5
    """Most fraction of wall time spent in training steps, in (0, 1]. Default 0.5."""
    train_below: float = 1.0
    """Train only while the generators' live batch is at most this fraction of their capacity
    (1.0, the default, trains whenever the duty cycle allows; 0.25 trains in the tail phase only)."""
    pause_during_train_step: bool = False
    """Pause the drafter trainer while the trainer takes its own optimizer step (both on one
    machine's cores). Default false."""
    acceptance_floor: float = 0.0
    """Warn when the acceptance length under a new policy version falls below this (a drafter not
    keeping up, or not updated): in the trainer's log and the launcher's output; at most
    ``generator.engine.num_draft_tokens + 1``, the most an acceptance length can be; 0 (default) never warns."""
    kv_cache_gb: float = 0.25
    """Memory of each generator for the drafter's own K/V, in GiB: at least one request's worth (a
    ``generator.engine.max_model_len``-token request plus its drafts, at the drafter's one layer of
    K/V per token), or a generator that drafts with ``eagle`` refuses to start; at most 1024. Default 0.25."""
    linger_s: float = 1.0
    """On shutdown: seconds the drafter trainer's ``Dead`` may take to be delivered, at most 60. Default 1.0."""
    device: str = "cpu"
    """Torch device the drafter trainer trains on. Default ``cpu``."""
    warm_start_minutes: float = 0.0
    """A warm start made before the run, in CPU-minutes of training (``time.process_time()``, every
    thread counted): when the drafter trainer runs and ``path`` is unset, ``specroll launch`` first
    finds in ``warm_start_cache_dir`` — or makes, as ``specroll drafter init --config RUN_DIR/config.toml``
    does — a head trained on ``warm_start_rollouts`` responses to the task's training prompts at
    ``generator.sampling``'s settings, and starts the generators and the drafter trainer with it as
    ``path``; the drafter trainer then follows the policy from there. A resumed run (a drafter in
    ``RUN_DIR/drafter``) keeps its own. Needs a single-turn task (no ``task.environment``) and
    ``cluster.backend = "local"`` (the head is cached on the launcher's host). 0 to 10080 (a week);
    0 (default): off."""
    warm_start_rollouts: int = 128
    """Responses the warm start generates (one per training prompt, in a seeded order, and round
    again when there are fewer prompts), 1 to 100,000 (``MAX_WARM_START_ROLLOUTS``). Default 128."""
    warm_start_cache_dir: str | None = None
    """The warm-start cache: one folder per key of what determines the head (the model's files, the
    task, the sampling and head settings, the budget, the rollout count, the seed), each holding the
    head and ``warm_start.json``. ``None`` (default): ``$XDG_CACHE_HOME/specroll/drafters``
    (``~/.cache/specroll/drafters``)."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(self.path is None or bool(self.path), "path", self.path, "a directory or unset")
        _require(self.learning_rate > 0 and math.isfinite(self.learning_rate), "learning_rate",
                 self.learning_rate, "a positive finite number")
        for name, most in _COUNTS.items():
            _require_count(name, getattr(self, name), 1, most)
        _require(self.min_rollouts <= self.window_rollouts, "min_rollouts", self.min_rollouts,
                 f"at most window_rollouts = {self.window_rollouts} (the replay buffer never holds more: a cold "
                 "start would never train)")
        _require(self.window_tokens >= self.ttt_steps + 2, "window_tokens", self.window_tokens,
                 f"an integer >= ttt_steps + 2 = {self.ttt_steps + 2} (ttt_steps={self.ttt_steps}; the first draft "
                 f"predicts x_(t+2))")
        _require(self.hidden_weight >= 0 and math.isfinite(self.hidden_weight), "hidden_weight", self.hidden_weight,
                 "a finite number >= 0")
        _require(0 < self.duty_cycle <= 1, "duty_cycle", self.duty_cycle, "a number in (0, 1]")
        _require(0 <= self.train_below <= 1, "train_below", self.train_below, "a number in [0, 1]")
        _require(self.acceptance_floor >= 0 and math.isfinite(self.acceptance_floor), "acceptance_floor",
                 self.acceptance_floor, "a finite number >= 0 (0 never warns)")
        _require(0 < self.kv_cache_gb <= MAX_KV_CACHE_GB, "kv_cache_gb", self.kv_cache_gb,
                 f"a number of GiB in (0, {MAX_KV_CACHE_GB:g}]")
        _require_seconds("linger_s", self.linger_s, 60)
        _require(bool(self.device), "device", self.device, "a torch device, e.g. 'cpu'")
        _require(0 <= self.warm_start_minutes <= 10080 and math.isfinite(self.warm_start_minutes),
                 "warm_start_minutes", self.warm_start_minutes, "CPU-minutes in [0, 10080] (0: no warm start)")
        _require(1 <= self.warm_start_rollouts <= MAX_WARM_START_ROLLOUTS, "warm_start_rollouts",
                 self.warm_start_rollouts, f"an integer in [1, {MAX_WARM_START_ROLLOUTS}]")
        _require(self.warm_start_cache_dir is None or bool(self.warm_start_cache_dir.strip()), "warm_start_cache_dir",
                 self.warm_start_cache_dir, "a directory path or unset (~/.cache/specroll/drafters)")

    def learner_config(self, seed: int) -> LearnerConfig:
        """The drafter learner's settings (``drafter/`` is a layer below the actors and keeps its own
        struct, as ``engine/`` keeps :class:`EngineConfig`): this section's training fields, renamed
        once here (``learning_rate`` → ``lr``, ``window_tokens`` → ``window``, ``window_rollouts`` →
        ``buffer_rollouts``), and the run's ``seed``.

        Raises:
            ValueError: a value the learner refuses.
        """
        return LearnerConfig(lr=self.learning_rate, batch=self.batch, window=self.window_tokens,
                             ttt_steps=self.ttt_steps, hidden_weight=self.hidden_weight,
                             objective=self.objective, buffer_rollouts=self.window_rollouts,
                             min_rollouts=self.min_rollouts,
                             draft_vocab_size=self.draft_vocab_size, features=self.features, seed=seed,
                             architecture=self.architecture)
