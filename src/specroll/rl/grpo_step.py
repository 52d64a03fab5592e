"""One GRPO training step on finished groups: the padded batch, the staleness bound and the update.

Synchronous torch code with no I/O, called by the trainer actor in a worker thread:

* :func:`build_batch` turns B finished groups (n samples each) and their rewards into one
  right-padded batch of prompt + response token ids, with the loss mask over response tokens and
  each token's behavior logprob and policy version aligned with it (``rl/grpo.py``'s layout:
  entry ``[b, t]`` describes token ``t`` of row ``b``);
* :func:`train_step` enforces the staleness bound η per token, runs the differentiable forward
  (``CausalLM.score``) over ``grad_accum_steps`` micro-batches, accumulates the gradient of the
  off-policy-corrected token-level loss (one token mean over the whole step), clips the global
  gradient norm and takes one AdamW step. On the way it measures the training–inference mismatch
  (:class:`Mismatch`): the trainer's own logprob of every lag-0 token against the behavior logprob
  the generator recorded for it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specroll.engine.model import CausalLM
from specroll.rl.coordinator import Group
from specroll.rl.grpo import LossKind, StalenessPolicy, apply_staleness, group_advantages, policy_loss, token_logprobs


@dataclass(frozen=True)
class RolloutBatch:
    """B = G·n samples as one right-padded training batch (T = longest prompt + response)."""

    input_ids: torch.Tensor
    """int64 ``[B, T]``: prompt then response token ids, padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """bool ``[B, T]``: True at real (prompt or response) tokens."""
    loss_mask: torch.Tensor
    """bool ``[B, T]``: True at response tokens (the ones trained on)."""
    behavior_logprobs: torch.Tensor
    """float32 ``[B, T]``: the generators' logprob of each response token (0 elsewhere)."""
    versions: torch.Tensor
    """int64 ``[B, T]``: the policy version that sampled each response token (``fill_version``
    elsewhere; never read there)."""
    advantages: torch.Tensor
    """float32 ``[B]``: the GRPO advantage of each sample (shared by its tokens)."""


def build_batch(
    groups: Sequence[Group], rewards: torch.Tensor, *, normalize_std: bool, fill_version: int, pad_id: int = 0
) -> RolloutBatch:
    """Pad the samples of ``groups`` into one batch; row ``g·n + i`` is sample ``i`` of group ``g``.

    Args:
        groups: G finished groups of n samples each.
        rewards: float ``[G, n]``: the reward of every sample.
        normalize_std: GRPO (divide by the group's std) or Dr. GRPO advantages.
        fill_version: version written at prompt and padding positions (outside the loss mask).
        pad_id: token id at padding positions (masked everywhere; any valid id).

    Raises:
        ValueError: no groups, groups of unequal size, ``rewards`` not ``[G, n]``, or a sample whose
            token ids, logprobs and versions differ in length.
    """
    if not groups:
        raise ValueError("build_batch needs at least one group")
    n = len(groups[0].samples)
    if any(len(g.samples) != n for g in groups) or tuple(rewards.shape) != (len(groups), n):
        raise ValueError(f"expected {len(groups)} groups of {n} samples and rewards [G, n]; got group sizes "
                         f"{[len(g.samples) for g in groups]} and rewards {tuple(rewards.shape)}")
    advantages = group_advantages(rewards, normalize_std).flatten()  # [B]
    rows = [(g.prompt_token_ids, s) for g in groups for s in g.samples]
    for g in groups:
        for i, s in enumerate(g.samples):
            if not len(s.token_ids) == len(s.logprobs) == len(s.versions):
                raise ValueError(f"group {g.group_id} sample {i}: {len(s.token_ids)} tokens, {len(s.logprobs)} "
                                 f"logprobs and {len(s.versions)} versions")
    b, t = len(rows), max(len(p) + len(s.token_ids) for p, s in rows)
    input_ids = torch.full((b, t), pad_id, dtype=torch.int64)  # [B, T]
    attention_mask = torch.zeros(b, t, dtype=torch.bool)  # [B, T]
    loss_mask = torch.zeros(b, t, dtype=torch.bool)  # [B, T]
    behavior = torch.zeros(b, t, dtype=torch.float32)  # [B, T]
    versions = torch.full((b, t), fill_version, dtype=torch.int64)  # [B, T]
    for row, (prompt, s) in enumerate(rows):
        p, r = len(prompt), len(s.token_ids)
        input_ids[row, :p] = torch.tensor(prompt, dtype=torch.int64)
        attention_mask[row, : p + r] = True
        if r:
            input_ids[row, p : p + r] = torch.tensor(s.token_ids, dtype=torch.int64)
            loss_mask[row, p : p + r] = True
            behavior[row, p : p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
            versions[row, p : p + r] = torch.tensor(s.versions, dtype=torch.int64)
    return RolloutBatch(input_ids, attention_mask, loss_mask, behavior, versions, advantages)


@dataclass
class Mismatch:
    """Training–inference logprob mismatch over the lag-0 response tokens of a step: tokens sampled by
    the very weights being trained, so any gap is numerics (dtype, kernels, batch shapes) or K/V kept
    across a weight update (``kv_policy = "keep"``), not learning.

    With ``d = log π_trainer(x) − log μ_behavior(x)`` per token: ``diff_mean`` = mean |d|,
    ``diff_max`` = max |d|, ``kl_k3`` = mean ``(e^d − 1) − d``, the k3 estimator of KL(μ ‖ π) from
    samples of μ (J. Schulman, "Approximating KL Divergence", 2020), ≥ 0 per token. All None when the
    step trained no lag-0 token. The behavior logprob is under the processed sampling distribution,
    so the comparison is exact only at temperature 1 without top-k/top-p (the default).
    """

    tokens: int = 0
    diff_mean: float | None = None
    diff_max: float | None = None
    kl_k3: float | None = None

    def add(self, logprobs: torch.Tensor, behavior: torch.Tensor) -> None:
        """Fold in one micro-batch: ``logprobs`` and ``behavior`` are float ``[N]`` over its lag-0 tokens."""
        if logprobs.numel() == 0:
            return
        d = (logprobs.double() - behavior.double())  # [N]
        n, total = int(d.numel()), self.tokens + int(d.numel())
        mean_abs, k3 = float(d.abs().mean()), float((torch.expm1(d) - d).mean())
        self.diff_mean = mean_abs if self.diff_mean is None else (self.diff_mean * self.tokens + mean_abs * n) / total
        self.kl_k3 = k3 if self.kl_k3 is None else (self.kl_k3 * self.tokens + k3 * n) / total
        self.diff_max = max(self.diff_max or 0.0, float(d.abs().max()))
        self.tokens = total


@dataclass
class StepResult:
    """What one :func:`train_step` did (loss diagnostics averaged over its trained tokens)."""

    loss: float
    """The step's loss (sum over micro-batches of their share of the token mean)."""
    is_weight_mean: float
    truncated_fraction: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    """Global gradient L2 norm before clipping."""
    trained_tokens: int
    """Response tokens in the loss after the staleness bound."""
    tokens_masked_stale: int
    """Response tokens the staleness bound removed from the loss."""
    samples_dropped_stale: int
    """Samples removed whole (``staleness_policy = "drop"``)."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Version lag → number of trained tokens with that lag."""
    mismatch: Mismatch = field(default_factory=Mismatch)
    """The trainer's logprobs against the behavior logprobs on lag-0 tokens."""

    @property
    def max_lag(self) -> int:
        """Largest version lag of a trained token (0 when none was trained)."""
        return max(self.staleness, default=0)


class StepSettings(Protocol):
    """What one step reads of the trainer's settings (the run config's ``TrainerConfig`` is one;
    this layer names only the fields, as it imports nothing of the actors)."""

    @property
    def max_staleness(self) -> int: ...
    @property
    def staleness_policy(self) -> StalenessPolicy: ...
    @property
    def grad_accum_steps(self) -> int: ...
    @property
    def loss(self) -> LossKind: ...
    @property
    def tis_cap(self) -> float: ...
    @property
    def clip_eps(self) -> float: ...
    @property
    def max_grad_norm(self) -> float: ...


def train_step(
    model: CausalLM, optimizer: torch.optim.Optimizer, batch: RolloutBatch, current_version: int,
    config: StepSettings,
) -> StepResult:
    """One optimizer step of GRPO on ``batch``, trained as policy version ``current_version``.

    Tokens lagging more than η = ``config.max_staleness`` versions leave the loss (``mask``) or take
    their sample with them (``drop``) — ``grpo.apply_staleness``. The token-level mean spans the
    whole step (N = trained tokens of all micro-batches), so accumulating over ``grad_accum_steps``
    micro-batches gives the gradient of one large batch. A step with no trained token still steps
    the optimizer (its loss is a zero; AdamW's moments decay as usual).

    Raises:
        ValueError: a trained token newer than ``current_version`` (from ``apply_staleness``).
        FloatingPointError: the gradient norm is not finite (nothing is updated).
    """
    mask, masked, dropped = apply_staleness(batch.loss_mask, batch.versions, current_version,
                                            config.max_staleness, config.staleness_policy)
    total = int(mask.sum())
    lags = Counter((current_version - batch.versions[mask]).tolist())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    sums = dict.fromkeys(("is_weight_mean", "truncated_fraction", "clip_fraction", "approx_kl"), 0.0)
    loss_sum = 0.0
    lengths = batch.attention_mask.sum(dim=1)  # [B]
    lag0 = batch.loss_mask & (batch.versions == current_version)  # [B, T]: sampled by the weights trained now
    mismatch = Mismatch()
    for rows in torch.arange(batch.input_ids.shape[0]).tensor_split(config.grad_accum_steps):
        if rows.numel() == 0:
            continue
        t = int(lengths[rows].max())  # trim the micro-batch to its own longest row
        ids, attn = batch.input_ids[rows, :t], batch.attention_mask[rows, :t]  # [b, t]
        logprobs = token_logprobs(model.score(ids, attn), ids)  # [b, t]
        fresh = lag0[rows, :t]  # [b, t]
        mismatch.add(logprobs.detach()[fresh], batch.behavior_logprobs[rows, :t][fresh])
        loss, m = policy_loss(logprobs, batch.behavior_logprobs[rows, :t], batch.advantages[rows], mask[rows, :t],
                              kind=config.loss, tis_cap=config.tis_cap, clip_eps=config.clip_eps,
                              num_tokens=max(total, 1))
        loss.backward()
        loss_sum += float(loss.detach())
        for key in sums:  # token-weighted, so the step's figure is the mean over all its tokens
            sums[key] += m[key] * m["tokens"]  # type: ignore[literal-required]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm or math.inf))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"gradient norm is {grad_norm} at policy version {current_version}; "
                                 "no update taken (lower trainer.learning_rate?)")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    k = max(total, 1)
    return StepResult(loss=loss_sum, grad_norm=grad_norm, trained_tokens=total, tokens_masked_stale=masked,
                      samples_dropped_stale=dropped, staleness=dict(sorted(lags.items())), mismatch=mismatch,
                      **{key: value / k for key, value in sums.items()})
