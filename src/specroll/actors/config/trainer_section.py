"""``[trainer]``: GRPO training with off-policy correction — batch, loss, staleness bound,
checkpoints, threads and ranks of the trainer."""

from __future__ import annotations

import math
from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.actors.config.section import require_count as _require_count
from specroll.engine.config import MAX_NUM_THREADS
from specroll.protocol.limits import MAX_GROUP_SIZE
from specroll.rl.coordinator import MAX_QUEUED_GROUPS
from specroll.rl.group_retries import MAX_GROUP_RETRIES

MAX_BATCH_GROUPS = 1 << 16
"""The most groups a step may take (``batch_groups``): every sample of a batch is held in memory."""
MAX_STALENESS = 10_000
"""The largest ``max_staleness``: a bound of more versions than that bounds nothing."""


class TrainerConfig(_Section):
    """GRPO training with off-policy correction (``[trainer]``)."""

    mode: Literal["async", "sync"] = "async"
    """``async`` (default): the off-step pipeline — a step trains on the first ``batch_groups``
    finished groups while generation goes on. ``sync``: the in-house baseline — submit
    ``batch_groups`` groups, wait until every rollout of them finished, train, publish and wait until
    every generator serves the new weights, then the next step; no speculation (``generator.speculative``
    resolves to ``off`` and the drafter trainer is not started)."""

    batch_groups: int = 4
    """B: finished groups that make one training step, 1 to 65536. Default 4."""
    group_size: int = 4
    """n: samples per prompt (a GRPO group). Default 4; at least 2, as one sample has no advantage, and at
    most 65536 (with single-turn groups, ``specroll launch`` also checks it is at most
    ``generator.engine.max_num_seqs``: a group's samples run on one generator)."""
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
    """η: most policy versions a trained token may lag behind the version being trained, 0 to 10,000.
    Default 1."""
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
    the trainer and ``specroll launch`` warn when this is above it). At most 1,048,576. Default 8."""
    max_group_retries: int = 3
    """Times a group is retried after one of its samples failed — a chunk the trainer refused (a token
    id outside the vocabulary, a gap in the stream), a generator that died with it or refused it, an
    episode that failed (``task.environment``) — each failure of any of its samples counting once; one
    failure more drops the whole group: none of its samples is trained (a partial group's advantages
    would favour whatever fails less), and ``groups_dropped`` counts it by reason
    (``specroll/rl/group_retries.py``). A retried group resumes on another generator from the tokens
    already streamed; a failed episode runs again from its start. 0 to 100. Default 3."""
    dropped_prompts: Literal["skip", "retry"] = "skip"
    """What happens to the prompt of a dropped group: ``skip`` (default) leaves it out until the next
    pass over the prompts (a prompt that failed a group ``max_group_retries + 1`` times would most
    likely fail again at once); ``retry`` serves it again next, with the same sampling seed."""
    max_queued_groups: int = 1024
    """Groups waiting in the rollout hub for a generator with room, every kind together (training,
    held-out evaluation, served requests); one more is refused — the embedding client's ``submit``
    raises ``QueueFull``, the HTTP server answers 429. At least ``max_groups_in_flight`` + ``eval.count``
    (with evaluations) + ``server.max_requests_in_flight`` (with ``server.enabled`` or episodes): what
    the trainer, its evaluation and its server may queue at once; at most 1,048,576. Default 1024."""
    train_threads: int | None = None
    """Torch intra-op CPU threads of the trainer (of each rank); ``None`` (default): under ``specroll
    launch`` on a CPU, half the cores divided among the ranks (the launcher's CPU budget,
    ``actors/launch/cpu_budget.py``), else torch's default. At most 1024."""

    borrow_threads: int | None = None
    """Torch threads the trainer adds for a phase of a step (each micro-batch's forward, its backward,
    the AdamW step) while no rollout is queued or generating — the generators' cores are idle then;
    0 never borrows. At most 1024 (as ``train_threads``). ``None``
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
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Arithmetic of the training step's forward and backward: ``fp32`` runs them in the
    parameters' dtype (``model.dtype``); ``bf16`` is mixed precision — matmuls and attention in
    bfloat16 under autocast, the float32 parameters and AdamW state as master weights, the LM head's
    log-softmax in float32 — on the CPU (fast only where it has AVX512-BF16 or AMX: elsewhere torch
    emulates it, many times slower than ``fp32``) and on CUDA; ``auto`` (default) is ``bf16`` where
    bf16 is native (those CPUs, CUDA GPUs that support it) and ``fp32`` elsewhere; the trainer's log
    says which it chose. Its cost
    shows in the ``logprob_diff_mean`` / ``logprob_kl_k3`` metrics (the trainer's logprobs against
    the generators'); docs/running-rl.md, "Training precision"."""
    head_chunk: int = 512
    """Response tokens whose LM-head logits exist at once in the training step, forward and
    backward (``engine/head_logprobs.py``): the ``[tokens, vocab]`` logits of a micro-batch are never
    held whole (512 × SmolLM2's 49,152: 100 MB in float32). 0 computes the whole head at once with
    plain autograd (its memory grows with the micro-batch's response tokens). At most 1,048,576.
    Default 512."""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require_count("batch_groups", self.batch_groups, 1, MAX_BATCH_GROUPS)
        _require(1 <= self.world_size <= self.batch_groups, "world_size", self.world_size,
                 f"an integer in [1, batch_groups = {self.batch_groups}] (every rank trains at least one group)")
        _require(self.borrow_threads is None or 0 <= self.borrow_threads <= MAX_NUM_THREADS, "borrow_threads",
                 self.borrow_threads, f"an integer in [0, {MAX_NUM_THREADS}] or unset")
        _require(2 <= self.group_size <= MAX_GROUP_SIZE, "group_size", self.group_size,
                 f"an integer in [2, {MAX_GROUP_SIZE}] (a group of one sample has zero advantage)")
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
        _require_count("max_staleness", self.max_staleness, 0, MAX_STALENESS)
        _require(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every,
                 "an integer >= 0 (0: only the final checkpoint)")
        _require(self.batch_groups <= self.max_groups_in_flight <= MAX_QUEUED_GROUPS, "max_groups_in_flight",
                 self.max_groups_in_flight, f"an integer in [batch_groups = {self.batch_groups}, {MAX_QUEUED_GROUPS}] "
                 "(below batch_groups a step could never fill)")
        _require(0 <= self.max_group_retries <= MAX_GROUP_RETRIES, "max_group_retries", self.max_group_retries,
                 f"an integer in [0, {MAX_GROUP_RETRIES}]")
        _require(1 <= self.max_queued_groups <= MAX_QUEUED_GROUPS, "max_queued_groups", self.max_queued_groups,
                 f"an integer in [1, {MAX_QUEUED_GROUPS}]")
        _require(0 <= self.head_chunk <= 1 << 20, "head_chunk", self.head_chunk,
                 "an integer in [0, 1048576] (0: the whole head at once)")
        _require(self.train_threads is None or 1 <= self.train_threads <= MAX_NUM_THREADS, "train_threads",
                 self.train_threads, f"an integer in [1, {MAX_NUM_THREADS}] or unset")
