"""Run configuration: strict structs for a whole run, loaded from TOML with ``--set a.b=value`` overrides.

One :class:`RunConfig` describes everything ``specroll launch`` starts (trainer, generators,
drafter trainer) and every role started alone reads the same file. ``RunConfig()`` is a small valid
run on a CPU: the default model, the built-in arithmetic task, one generator.

* :func:`~specroll.actors.config.load.load_config` reads a file (or nothing: the defaults), applies
  overrides and validates (reading, overrides and error messages: ``parse.py``).
* :func:`~specroll.actors.config.dump.dump_config` writes TOML;
  :func:`~specroll.actors.config.dump.write_resolved` writes ``RUN_DIR/config.toml`` atomically, and
  ``load_config(write_resolved(c, d)) == c`` (``dump.py``, which imports this module; the package
  ``specroll.actors.config`` re-exports both).
* Every problem is one :class:`~specroll.actors.config.errors.ConfigError` naming the file, the
  dotted key and what was expected.

Every struct is frozen and forbids unknown fields; ranges are checked in ``__post_init__`` (which
raises ``ValueError`` naming the field, the value and what was expected), so a config built in code
is checked exactly like one loaded from a file. An optional field always defaults to ``None``: TOML
has no null, so :func:`dump_config` omits ``None`` and the round trip relies on it.

Layering: the generator section nests :class:`~specroll.engine.config.EngineConfig` and the drafter
section builds the drafter layer's :class:`~specroll.drafter.learner.LearnerConfig`
(:meth:`DrafterConfig.learner_config`), so this module lives in ``actors/`` (which may import every
layer) rather than in ``protocol/``, which stays a leaf.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from specroll.actors.config.cluster_section import ClusterConfig
from specroll.actors.config.launch_section import LaunchConfig
from specroll.actors.config.network_section import NetworkConfig
from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.drafter.learner_config import LearnerConfig
from specroll.engine.config import EngineConfig
from specroll.engine.loaders.registry import DEFAULT_MODEL
from specroll.protocol.sampling import SamplingParams


class ModelSection(_Section):
    """The policy: the model the trainer trains and every generator serves (``[model]``)."""

    name: str = DEFAULT_MODEL
    """A registered model name, a Hugging Face checkpoint directory or a ``.gguf`` file. Default: the
    registered default model (SmolLM2-135M-Instruct)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trainer's parameters and optimizer state. Default ``float32``. (The generators'
    inference dtype is ``generator.engine.dtype``.)"""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(bool(self.name), "name", self.name, "a model name or path")


class TaskConfig(_Section):
    """Where prompts come from and how responses are scored (``[task]``)."""

    prompts: str | None = None
    """GSM8K-style JSONL file (``question`` and ``answer`` per line); ``None`` (default) uses the
    built-in task: "What is a op b?" (``digits``, ``operators``; ``specroll.rl.tasks.builtin_task``)."""
    reward: Literal["gsm8k"] = "gsm8k"
    """Reward function from ``specroll.rl.tasks.REWARDS``: ``gsm8k`` (default) scores 1 when the
    last number of the response equals the answer."""
    max_prompts: int | None = None
    """Use at most this many prompts of the file; ``None`` (default) uses them all."""
    builtin_count: int = 256
    """Training prompts the built-in task draws (used when ``prompts`` is ``None``; fewer when its
    problems run out: one-digit ``+-*`` problems number 255, of which ``eval.count`` are held out).
    Default 256."""
    digits: int = 1
    """The built-in task's difficulty: digits of each operand, 1 to 3. Default 1 (SmolLM2-135M-Instruct
    answers about 20% of one-digit ``+-*`` problems correctly at temperature 1)."""
    operators: str = "+-*"
    """The built-in task's operators: distinct characters of ``+-*`` (subtraction never goes below 0).
    Default ``+-*``."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(1 <= self.digits <= 3, "digits", self.digits, "an integer in [1, 3]")
        _require(bool(self.operators) and set(self.operators) <= set("+-*")
                 and len(set(self.operators)) == len(self.operators), "operators", self.operators,
                 "distinct characters of '+-*'")
        _require(self.prompts is None or bool(self.prompts), "prompts", self.prompts, "a file path or unset")
        _require(self.max_prompts is None or self.max_prompts >= 1, "max_prompts", self.max_prompts,
                 "a positive integer or unset")
        _require(self.builtin_count >= 1, "builtin_count", self.builtin_count, "a positive integer")


class EvalConfig(_Section):
    """Held-out evaluation (``[eval]``): a fixed set of prompts never trained on, one sample each,
    generated by the generators under the current weights before the first step, every ``every``
    steps and after the last; ``eval_accuracy`` goes into that step's metrics line."""

    every: int = 5
    """Steps between evaluations; 0 disables evaluation. Default 5."""
    count: int = 64
    """Evaluation prompts. Built-in task: a held-out set fixed by ``task.digits`` and ``task.operators``
    (the same for every seed); a prompt file without ``eval.prompts``: its last ``count`` prompts, which
    training then never draws. Default 64."""
    prompts: str | None = None
    """A JSONL file of evaluation prompts (its first ``count``), e.g. GSM8K's test split; ``None``
    (default): held out from the task as above."""
    greedy: bool = False
    """Decode evaluation greedily; false (default) samples at the training sampling settings with a
    fixed seed per prompt, so every evaluation of a run draws the same random numbers and differences
    between them come from the weights."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "every", self.every, "an integer >= 0 (0 disables evaluation)")
        _require(self.count >= 1, "count", self.count, "a positive integer")
        _require(self.prompts is None or bool(self.prompts), "prompts", self.prompts, "a file path or unset")


class TrainerConfig(_Section):
    """GRPO training with off-policy correction (``[trainer]``)."""

    mode: Literal["async", "sync"] = "async"
    """``async`` (default): the off-step pipeline — a step trains on the first ``batch_groups``
    finished groups while generation goes on. ``sync``: the in-house baseline — submit
    ``batch_groups`` groups, wait until every rollout of them finished, train, publish and wait until
    every generator serves the new weights, then the next step; no speculation (``generator.speculative``
    resolves to ``off`` and the drafter trainer is not started)."""

    batch_groups: int = 4
    """B: finished groups that make one training step. Default 4."""
    group_size: int = 4
    """n: samples per prompt (a GRPO group). Default 4; at least 2, as one sample has no advantage."""
    learning_rate: float = 1e-6
    """AdamW learning rate. Default 1e-6."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay. Default 0."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping. Default 1.0."""
    grad_accum_steps: int = 1
    """Micro-batches one step's B·n samples are split into (one optimizer step); with several ranks,
    each rank's share of them (every rank runs as many). Default 1."""
    loss: Literal["tis", "ppo"] = "tis"
    """Off-policy correction against the behavior logprobs: ``tis`` (default) weighs each token's
    policy gradient by the truncated importance ratio min(π/μ, ``tis_cap``); ``ppo`` is the decoupled
    PPO clipped objective with clip range ``clip_eps``."""
    tis_cap: float = 2.0
    """Truncation C of the importance ratio in the ``tis`` loss. Default 2.0."""
    clip_eps: float = 0.2
    """ε of the ``ppo`` loss: ratios are clipped to [1-ε, 1+ε]. Default 0.2."""
    max_staleness: int = 1
    """η: most policy versions a trained token may lag behind the version being trained. Default 1."""
    staleness_policy: Literal["mask", "drop"] = "mask"
    """What happens to tokens older than η: ``mask`` (default) removes them from the loss;
    ``drop`` discards their whole sample. Both are counted in the metrics."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO). Default true."""
    checkpoint_every: int = 0
    """Save a checkpoint (weights, optimizer, step) every this many steps; 0 (default): only at the end
    of the run. A trainer started on a run directory with a checkpoint resumes from it."""
    weights_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of published weights on the wire; ``bfloat16`` halves the bytes. Default ``float32``."""
    max_groups_in_flight: int = 8
    """Groups queued, generating or finished and not yet taken by a step, at most; at least
    ``batch_groups``. The staleness bound also holds the groups not through a finished step (the one
    being trained included) to ``(max_staleness + 1) × batch_groups`` (``specroll/rl/admission.py``;
    the trainer and ``specroll launch`` warn when this is above it). Default 8."""
    train_threads: int | None = None
    """Torch intra-op CPU threads of the trainer (of each rank); ``None`` (default): under ``specroll
    launch`` on a CPU, half the cores divided among the ranks (the launcher's CPU budget,
    ``actors/launch/cpu_budget.py``), else torch's default."""

    borrow_threads: int | None = None
    """Torch threads the trainer adds for a micro-batch (``grad_accum_steps`` split a step) while no
    rollout is queued or generating — the generators' cores are idle then; 0 never borrows. ``None``
    (default): under ``specroll launch`` on a CPU, the generators' share of the cores (the launcher's
    CPU budget), else 0. With several ranks: per rank, decided once per step by rank 0."""
    world_size: int = 1
    """Trainer ranks: torch.distributed processes the policy and AdamW's state are sharded over with
    FSDP2 (on CUDA with NCCL, and on the CPU with gloo — no DDP fallback is needed); rank 0 talks to
    the generators and sends each step's batch to the others, each training its share of the groups
    (``actors/trainer/ranks/sharded.py``). ``specroll launch`` starts them all; alone, start them with
    ``torchrun --nproc-per-node N -m specroll.actors.trainer --config FILE``. ``train_threads``,
    ``borrow_threads`` and ``grad_accum_steps`` are per rank. At most ``batch_groups``. Default 1
    (one process, no process group)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer trains: ``cpu`` (default; gloo between ranks) or ``cuda`` (rank r on
    ``cuda:LOCAL_RANK``, NCCL between ranks)."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(self.batch_groups >= 1, "batch_groups", self.batch_groups, "a positive integer")
        _require(1 <= self.world_size <= self.batch_groups, "world_size", self.world_size,
                 f"an integer in [1, batch_groups = {self.batch_groups}] (every rank trains at least one group)")
        _require(self.borrow_threads is None or self.borrow_threads >= 0, "borrow_threads", self.borrow_threads,
                 "an integer >= 0 or unset")
        _require(self.group_size >= 2, "group_size", self.group_size,
                 "an integer >= 2 (a group of one sample has zero advantage)")
        _require(self.learning_rate > 0 and math.isfinite(self.learning_rate), "learning_rate",
                 self.learning_rate, "a positive finite number")
        _require(self.weight_decay >= 0 and math.isfinite(self.weight_decay), "weight_decay", self.weight_decay,
                 "a finite number >= 0")
        _require(self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm), "max_grad_norm",
                 self.max_grad_norm, "a finite number >= 0 (0 disables clipping)")
        samples = self.batch_groups * self.group_size
        _require(1 <= self.grad_accum_steps <= samples, "grad_accum_steps", self.grad_accum_steps,
                 f"an integer in [1, batch_groups * group_size = {samples}]")
        _require(self.tis_cap > 0, "tis_cap", self.tis_cap, "a positive number")
        _require(0 < self.clip_eps < 1, "clip_eps", self.clip_eps, "a number in (0, 1)")
        _require(self.max_staleness >= 0, "max_staleness", self.max_staleness, "an integer >= 0")
        _require(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every,
                 "an integer >= 0 (0 never checkpoints)")
        _require(self.max_groups_in_flight >= self.batch_groups, "max_groups_in_flight", self.max_groups_in_flight,
                 f"an integer >= batch_groups ({self.batch_groups}), or a step could never fill")
        _require(self.train_threads is None or self.train_threads >= 1, "train_threads", self.train_threads,
                 "a positive integer or unset")


class GeneratorConfig(_Section):
    """The generators: each wraps one engine and streams rollouts to the trainer (``[generator]``)."""

    count: int = 1
    """Generators ``specroll launch`` starts. Default 1."""
    engine: EngineConfig = EngineConfig()
    """The engine of each generator (``[generator.engine]``). Its ``model`` follows ``model.name``: leave
    it unset (or equal to ``model.name``). Its ``num_threads`` unset: under ``specroll launch`` on a
    CPU, the generators share the half of the cores the trainer does not get (the launcher's CPU budget)."""
    sampling: SamplingParams = SamplingParams()
    """How rollouts are sampled (``[generator.sampling]``): temperature, top_p, top_k, max_tokens.
    ``seed`` must stay unset: each request's seed derives from the run seed."""
    kv_policy: Literal["keep", "recompute"] = "keep"
    """What running requests do on a weight update: ``keep`` (default) reuses KV computed under the
    older weights (recorded per token); ``recompute`` prefills it again under the new ones."""
    stream_every_steps: int = 4
    """Engine steps between rollout chunks sent to the trainer (finished samples are sent at once).
    Default 4."""
    heartbeat_s: float = 1.0
    """Seconds between heartbeats to the trainer. Default 1.0."""
    speculative: Literal["off", "suffix", "eagle", "auto"] = "off"
    """Speculative decoding: ``off`` (default), ``suffix`` (model-free n-gram drafts), ``eagle``
    (the learned drafter; needs ``[drafter]``) or ``auto`` (``eagle`` when a drafter is configured,
    else ``suffix``)."""
    stats_s: float = 5.0
    """Seconds between ``Stats`` messages (engine throughput, draft acceptance) to the trainer.
    Default 5.0."""
    linger_s: float = 1.0
    """On a graceful stop: seconds to flush unsent chunks, then seconds to deliver ``Dead``. Default 1.0."""
    max_outbox: int = 256
    """Messages queued for the trainer before the step loop waits for it (backpressure, bounded
    memory). Default 256."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(self.count >= 1, "count", self.count, "a positive integer")
        _require(self.sampling.seed is None, "sampling.seed", self.sampling.seed,
                 "unset (per-request seeds derive from the run seed; one seed gives a group identical samples)")
        _require(self.stream_every_steps >= 1, "stream_every_steps", self.stream_every_steps, "a positive integer")
        _require(self.heartbeat_s > 0 and math.isfinite(self.heartbeat_s), "heartbeat_s", self.heartbeat_s,
                 "a positive number of seconds")
        for name in ("stats_s", "linger_s"):
            _require(getattr(self, name) > 0 and math.isfinite(getattr(self, name)), name, getattr(self, name),
                     "a positive number of seconds")
        _require(self.max_outbox >= 1, "max_outbox", self.max_outbox, "a positive integer")


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
    """Replay buffer: the most recent finished rollouts the drafter trains on. Default 256."""
    publish_every_steps: int = 20
    """Drafter training steps between published drafter versions. Default 20."""
    batch: int = 4
    """Windows per drafter training step. Default 4."""
    window_tokens: int = 128
    """Tokens per training window (ending in the response); at least ``ttt_steps + 2``, as the first
    draft predicts the token two past a window position. Default 128."""
    ttt_steps: int = 3
    """Unrolled draft steps of EAGLE-3's training-time-test loss. Default 3."""
    hidden_weight: float = 0.0
    """Weight of the optional hidden-state regression (SmoothL1 to the target's final hidden state,
    as TLT adds it); 0 (default, as EAGLE-3) trains on the soft cross-entropy only."""
    min_rollouts: int = 8
    """Rollouts needed before a cold start's first step. Default 8."""
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
    K/V per token), or a generator that drafts with ``eagle`` refuses to start. Default 0.25."""
    linger_s: float = 1.0
    """On shutdown: seconds the drafter trainer's ``Dead`` may take to be delivered. Default 1.0."""
    device: str = "cpu"
    """Torch device the drafter trainer trains on. Default ``cpu``."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(self.path is None or bool(self.path), "path", self.path, "a directory or unset")
        _require(self.learning_rate > 0 and math.isfinite(self.learning_rate), "learning_rate",
                 self.learning_rate, "a positive finite number")
        for name in ("window_rollouts", "publish_every_steps", "batch", "window_tokens", "ttt_steps", "min_rollouts",
                     "draft_vocab_size", "num_threads"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "a positive integer")
        _require(self.window_tokens >= self.ttt_steps + 2, "window_tokens", self.window_tokens,
                 f"an integer >= ttt_steps + 2 = {self.ttt_steps + 2} (ttt_steps={self.ttt_steps}; the first draft "
                 f"predicts x_(t+2))")
        _require(self.hidden_weight >= 0 and math.isfinite(self.hidden_weight), "hidden_weight", self.hidden_weight,
                 "a finite number >= 0")
        _require(0 < self.duty_cycle <= 1, "duty_cycle", self.duty_cycle, "a number in (0, 1]")
        _require(0 <= self.train_below <= 1, "train_below", self.train_below, "a number in [0, 1]")
        _require(self.acceptance_floor >= 0 and math.isfinite(self.acceptance_floor), "acceptance_floor",
                 self.acceptance_floor, "a finite number >= 0 (0 never warns)")
        _require(self.kv_cache_gb > 0 and math.isfinite(self.kv_cache_gb), "kv_cache_gb", self.kv_cache_gb,
                 "a positive number of GiB")
        _require(self.linger_s > 0 and math.isfinite(self.linger_s), "linger_s", self.linger_s,
                 "a positive number of seconds")
        _require(bool(self.device), "device", self.device, "a torch device, e.g. 'cpu'")

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
                             buffer_rollouts=self.window_rollouts, min_rollouts=self.min_rollouts,
                             draft_vocab_size=self.draft_vocab_size, features=self.features, seed=seed,
                             architecture=self.architecture)


class RunConfig(_Section):
    """A whole run: ``specroll launch`` and every role read it. ``RunConfig()`` is a small CPU run."""

    run_dir: str = "runs/default"
    """Directory of the run: resolved config, metrics JSONL, checkpoints. Default ``runs/default``."""
    seed: int = 0
    """Seed of the run: prompt order, per-request sampling seeds, initialisation. Default 0."""
    steps: int = 3
    """GRPO steps to train. Default 3."""
    model: ModelSection = ModelSection()
    task: TaskConfig = TaskConfig()
    trainer: TrainerConfig = TrainerConfig()
    generator: GeneratorConfig = GeneratorConfig()
    drafter: DrafterConfig = DrafterConfig()
    network: NetworkConfig = NetworkConfig()
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (``[eval]``)."""
    launch: LaunchConfig = LaunchConfig()
    """Supervision of the processes ``specroll launch`` starts (``[launch]``)."""
    cluster: ClusterConfig = ClusterConfig()
    """Where ``specroll launch`` places the roles: this host, or Ray actors on a cluster (``[cluster]``)."""

    def __post_init__(self) -> None:
        _require(bool(self.run_dir), "run_dir", self.run_dir, "a directory path")
        _require(self.seed >= 0, "seed", self.seed, "an integer >= 0")
        _require(self.steps >= 1, "steps", self.steps, "a positive integer")
        engine = self.generator.engine
        if engine.model != self.model.name:
            # The generators serve the policy: an engine model left at its default follows model.name.
            _require(engine.model == DEFAULT_MODEL, "generator.engine.model", engine.model,
                     f"unset or equal to model.name={self.model.name!r}")
            generator = msgspec.structs.replace(self.generator, engine=msgspec.structs.replace(
                engine, model=self.model.name))
            msgspec.structs.force_setattr(self, "generator", generator)
        _require(self.generator.speculative != "eagle" or self.drafter.enabled or self.drafter.path is not None,
                 "generator.speculative", self.generator.speculative,
                 "'off', 'suffix' or 'auto' unless drafter.enabled = true or drafter.path is set")
        _require(self.network.heartbeat_timeout_s > self.generator.heartbeat_s, "network.heartbeat_timeout_s",
                 self.network.heartbeat_timeout_s, f"more than generator.heartbeat_s = {self.generator.heartbeat_s}")
        k = engine.num_draft_tokens
        # The acceptance length (tokens per verify step) is at most k + 1: k drafts and a bonus token.
        _require(self.drafter.acceptance_floor <= k + 1, "drafter.acceptance_floor", self.drafter.acceptance_floor,
                 f"at most generator.engine.num_draft_tokens + 1 = {k + 1} (the acceptance length never exceeds "
                 f"k + 1 with k = {k} drafts per step), or 0 to never warn")

    def speculative(self) -> Literal["off", "suffix", "eagle"]:
        """``generator.speculative`` with ``auto`` resolved: ``eagle`` when a drafter is configured
        (``drafter.enabled`` or ``drafter.path``), else ``suffix``; ``off`` in ``trainer.mode = "sync"``."""
        mode = self.generator.speculative
        if self.trainer.mode == "sync":
            return "off"
        if mode == "auto":
            return "eagle" if self.drafter.enabled or self.drafter.path is not None else "suffix"
        return mode

    def runs_drafter_trainer(self) -> bool:
        """Whether ``specroll launch`` starts the drafter trainer: ``drafter.enabled``, except in
        ``trainer.mode = "sync"`` (which never speculates)."""
        return self.drafter.enabled and self.trainer.mode == "async"

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not what was meant, one line each naming the keys
        (``specroll launch`` and ``specroll drafter serve`` print them at start).

        * ``drafter.enabled`` with ``generator.speculative`` ``off`` or ``suffix``: the drafter trainer
          runs and saves its versions to ``RUN_DIR/drafter`` — a legitimate way to train a drafter for
          a later run's warm start (``drafter.path``) without spending generator time on drafting —
          but no generator drafts with them, which is more often a forgotten ``speculative``.
        * a non-loopback ``network.host`` with ``security = "none"`` (``allow_insecure``): nothing is
          authenticated.
        """
        found = []
        insecure = self.network.insecure_warning()
        if insecure is not None:
            found.append(insecure)
        mode = self.generator.speculative
        if self.runs_drafter_trainer() and mode in ("off", "suffix"):
            found.append(f"drafter.enabled = true with generator.speculative = {mode!r}: the drafter trainer trains "
                         f"and saves drafter versions to {self.run_dir}/drafter, but no generator drafts with them; "
                         f"set generator.speculative = 'auto' (or 'eagle') to draft with them")
        return found

    def served_drafter(self) -> str | None:
        """The drafter directory each generator serves from its first step (``drafter.path`` when
        :meth:`speculative` is ``eagle``), else ``None``."""
        return self.drafter.path if self.speculative() == "eagle" else None
