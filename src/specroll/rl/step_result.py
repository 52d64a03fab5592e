"""What one GRPO step reports (:class:`StepResult`, with its training–inference :class:`Mismatch`)
and what it reads of the trainer's settings (:class:`StepSettings`); the step itself is
``grpo_step.train_step``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from specroll.rl.grpo import LossKind, StalenessPolicy

Precision = Literal["auto", "fp32", "bf16"]


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

    def sums(self) -> tuple[float, float, float, float]:
        """``(tokens, Σ|d|, Σ k3, max |d|)``: what adds up across the ranks of a sharded step."""
        if self.tokens == 0:
            return 0.0, 0.0, 0.0, 0.0
        assert self.diff_mean is not None and self.kl_k3 is not None and self.diff_max is not None
        return float(self.tokens), self.diff_mean * self.tokens, self.kl_k3 * self.tokens, self.diff_max

    @classmethod
    def from_sums(cls, tokens: float, abs_sum: float, k3_sum: float, abs_max: float) -> Mismatch:
        """The mismatch of a whole step from :meth:`sums` added (max taken) over its ranks."""
        if tokens == 0:
            return cls()
        return cls(int(tokens), abs_sum / tokens, abs_max, k3_sum / tokens)


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

    @property
    def skipped(self) -> bool:
        """No token was in the loss (all masked or dropped as stale, or no response token): no
        optimizer step was taken and the loss diagnostics are 0."""
        return self.trained_tokens == 0


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
    @property
    def precision(self) -> Precision: ...
    @property
    def head_chunk(self) -> int: ...
