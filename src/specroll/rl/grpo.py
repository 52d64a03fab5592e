"""GRPO training maths: group advantages, token logprobs, staleness bound, off-policy-corrected loss.

Pure torch functions the trainer actor calls; no I/O, no state. Every per-token tensor is ``[B, T]``
and aligned with the token ids ``input_ids [B, T]`` of the padded training batch: entry ``[b, t]``
belongs to token ``t`` of row ``b`` (its logprob, its behavior logprob, the policy version that
sampled it, whether it is trained). Position 0 is never a trained token (it has no prediction).

Sources: GRPO (Shao et al. 2024, "DeepSeekMath", §4.1.2), Dr. GRPO (Liu et al. 2025,
"Understanding R1-Zero-Like Training"), DAPO's token-level mean (Yu et al. 2025), truncated
importance sampling (Espeholt et al. 2018, "IMPALA"; Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training"), decoupled PPO (Hilton et al. 2022, "Batch
size-invariance for policy optimization"; Fu et al. 2025, "AReaL", eq. 5).
"""

from __future__ import annotations

from typing import Literal, TypedDict

import torch

LossKind = Literal["tis", "ppo"]
StalenessPolicy = Literal["mask", "drop"]


class PolicyLossMetrics(TypedDict):
    """Diagnostics of one :func:`policy_loss` call, averaged over the trained (masked-in) tokens."""

    is_weight_mean: float
    """Mean behavior→current importance weight actually applied (after truncation at C)."""
    truncated_fraction: float
    """Fraction of tokens whose weight exceeded C and was truncated."""
    clip_fraction: float
    """PPO: fraction of tokens whose clipped term is active (no gradient); 0 for ``tis``."""
    approx_kl: float
    """KL(behavior ‖ current) estimated with k3 = (ρ − 1) − log ρ, ρ = π_θ/μ (Schulman 2020)."""
    tokens: int
    """Number of trained tokens."""


def _check_2d(name: str, tensor: torch.Tensor, shape: torch.Size | None = None) -> None:
    if tensor.dim() != 2 or (shape is not None and tensor.shape != shape):
        expected = "[B, T]" if shape is None else f"[B, T] = {tuple(shape)}"
        raise ValueError(f"{name} must be {expected}, got {tuple(tensor.shape)}")


def _check_mask(name: str, mask: torch.Tensor, shape: torch.Size) -> None:
    _check_2d(name, mask, shape)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be bool, got {mask.dtype}")


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalized advantages: one scalar per sample, shared by all its tokens.

    ``A_i = (r_i − mean(r)) / (std(r) + eps)`` over the n samples of a group (DeepSeekMath §4.1.2,
    outcome supervision); std is the unbiased (Bessel) estimate, as TRL and verl compute it. With
    ``normalize_std=False`` it is ``A_i = r_i − mean(r)`` (Dr. GRPO, Liu et al. 2025, which drops
    the std division as a difficulty bias). A group whose rewards are all equal carries no signal
    and gets exactly zero advantage (not a rounding residue divided by eps).

    Args:
        rewards: float ``[G, n]``: G groups of n samples.
        normalize_std: divide by the group's std (GRPO) or not (Dr. GRPO).
        eps: added to the std before dividing.

    Returns:
        float32 ``[G, n]``.

    Raises:
        ValueError: ``rewards`` is not a 2-D floating tensor.
    """
    if rewards.dim() != 2 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be float [G, n], got {rewards.dtype} {tuple(rewards.shape)}")
    r = rewards.float()
    centered = r - r.mean(dim=1, keepdim=True)  # [G, n]
    if normalize_std:
        std = r.std(dim=1, keepdim=True, correction=1 if r.shape[1] > 1 else 0)  # [G, 1]
        centered = centered / (std + eps)
    equal = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))  # [G, 1]
    return torch.where(equal, torch.zeros_like(centered), centered)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``log p(x_t | x_<t)`` of every token under ``logits``, aligned with the tokens.

    ``out[b, t] = log_softmax(logits[b, t − 1])[input_ids[b, t]]`` for t ≥ 1 and ``out[b, 0] = 0``
    (the first token has no prediction), so the result lines up with behavior logprobs, versions
    and loss masks indexed by token. Computed as ``gather − logsumexp`` in float32, which never
    materialises a second ``[B, T, V]`` tensor of log-probabilities. Differentiable in ``logits``.

    Args:
        logits: ``[B, T, V]`` (any float dtype; e.g. from ``CausalLM.score``).
        input_ids: int64 ``[B, T]``.

    Returns:
        float32 ``[B, T]``.

    Raises:
        ValueError: shapes disagree (logits not ``[B, T, V]`` for input_ids ``[B, T]``).
    """
    if logits.dim() != 3 or input_ids.dim() != 2 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits must be [B, T, V] for input_ids [B, T]; got logits {tuple(logits.shape)}, "
            f"input_ids {tuple(input_ids.shape)}"
        )
    logp = target_logprobs(logits[:, :-1], input_ids[:, 1:])  # [B, T-1]: position t-1 predicts token t
    return torch.cat([logp.new_zeros(logp.shape[0], 1), logp], dim=1)  # [B, T]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., target]``: float32 ``[...]`` for logits ``[..., V]`` and int
    ``targets`` ``[...]``, as ``gather − logsumexp`` in float32 (no second ``[..., V]`` tensor).
    Differentiable in ``logits``."""
    pred = logits.float()
    return pred.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - pred.logsumexp(dim=-1)


def staleness_mask(versions: torch.Tensor, current_version: int, max_staleness: int) -> torch.Tensor:
    """True where a token is fresh enough to train on: ``current_version − version ≤ max_staleness``.

    Args:
        versions: int64 ``[B, T]``: the policy version that sampled each token.
        current_version: the version of the weights being trained.
        max_staleness: η ≥ 0, the largest allowed version lag in policy updates.

    Returns:
        bool ``[B, T]``.

    Raises:
        ValueError: ``versions`` is not 2-D integer, or ``max_staleness`` < 0.
    """
    if versions.dim() != 2 or versions.is_floating_point() or versions.dtype == torch.bool:
        raise ValueError(f"versions must be int64 [B, T], got {versions.dtype} {tuple(versions.shape)}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return current_version - versions <= max_staleness


def apply_staleness(
    loss_mask: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
    max_staleness: int,
    policy: StalenessPolicy,
) -> tuple[torch.Tensor, int, int]:
    """Enforce the staleness bound η on the trained tokens (``loss_mask``) of a batch.

    ``mask``: trained tokens older than η leave the loss, the rest of their sample stays.
    ``drop``: a sample with any trained token older than η leaves the loss entirely.
    Tokens outside ``loss_mask`` (prompt, padding) are ignored: their versions are never read.

    Args:
        loss_mask: bool ``[B, T]``: tokens to train on.
        versions: int64 ``[B, T]``: the policy version that sampled each token.
        current_version: the version of the weights being trained.
        max_staleness: η ≥ 0.
        policy: ``"mask"`` or ``"drop"``.

    Returns:
        ``(new_mask, num_tokens_masked, num_samples_dropped)``: bool ``[B, T]``; the trained tokens
        removed (under ``drop``, every trained token of a dropped sample); the samples removed
        (always 0 under ``mask``).

    Raises:
        ValueError: shapes or dtypes disagree, η < 0, an unknown policy, or a trained token whose
            version is newer than ``current_version`` (weights the trainer never published).
    """
    _check_mask("loss_mask", loss_mask, loss_mask.shape)
    _check_2d("versions", versions, loss_mask.shape)
    if policy not in ("mask", "drop"):
        raise ValueError(f"staleness policy must be 'mask' or 'drop', got {policy!r}")
    fresh = staleness_mask(versions, current_version, max_staleness)  # [B, T]
    future = loss_mask & (versions > current_version)
    if future.any():
        raise ValueError(
            f"{int(future.sum())} trained tokens carry versions up to {int(versions[future].max())}, "
            f"newer than the current version {current_version}"
        )
    stale = loss_mask & ~fresh  # [B, T]
    if policy == "mask":
        new_mask = loss_mask & fresh
        dropped = 0
    else:
        drop_rows = stale.any(dim=1)  # [B]
        new_mask = loss_mask & ~drop_rows[:, None]
        dropped = int(drop_rows.sum())
    return new_mask, int(loss_mask.sum() - new_mask.sum()), dropped


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kind: LossKind,
    tis_cap: float = 2.0,
    clip_eps: float = 0.2,
    proximal_logprobs: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """Off-policy-corrected token-level policy-gradient loss (to minimise).

    With π_θ the current policy (``logprobs``, differentiable), μ the behavior policy that sampled
    the tokens (``behavior_logprobs``), A the advantage and N the number of trained tokens
    (token-level mean, DAPO):

    - ``tis``, truncated importance sampling (IMPALA's truncated ρ; Yao et al. 2025):
      ``w = min(π_θ/μ, C)`` detached, ``loss = −Σ w · A · log π_θ / N``.
    - ``ppo``, decoupled PPO clip (Hilton et al. 2022; AReaL eq. 5) with proximal policy π_prox:
      ``r = π_θ/π_prox``, ``w = min(π_prox/μ, C)`` detached,
      ``loss = −Σ w · min(r·A, clip(r, 1−ε, 1+ε)·A) / N``. Without ``proximal_logprobs``,
      π_prox = π_θ detached (the first minibatch of a step: r = 1, and the gradient is TIS's).

    Tokens outside ``loss_mask`` contribute nothing to the loss or the gradient, whatever their
    values (even NaN or inf). With no trained token the loss is a zero that still backpropagates.

    Args:
        logprobs: float ``[B, T]``: log π_θ of each token (``token_logprobs``), differentiable.
        behavior_logprobs: float ``[B, T]``: log μ, as the generators reported.
        advantages: float ``[B]`` (one per sample) or ``[B, T]`` (per token).
        loss_mask: bool ``[B, T]``: tokens to train on.
        kind: ``"tis"`` or ``"ppo"``.
        tis_cap: C > 0, the truncation of the behavior importance weight.
        clip_eps: ε in (0, 1), PPO's clip range.
        proximal_logprobs: float ``[B, T]``: log π_prox (``ppo`` only; ignored by ``tis``).
        num_tokens: N, when the token mean spans more than this call (gradient accumulation:
            pass the trained tokens of the whole step); defaults to ``loss_mask.sum()``.

    Returns:
        ``(loss, metrics)``: float32 scalar, and :class:`PolicyLossMetrics` over this call's tokens.

    Raises:
        ValueError: shapes or dtypes disagree, an unknown ``kind``, C ≤ 0, ε outside (0, 1), or
            ``num_tokens`` < 1.
    """
    _check_2d("logprobs", logprobs)
    shape = logprobs.shape
    _check_2d("behavior_logprobs", behavior_logprobs, shape)
    _check_mask("loss_mask", loss_mask, shape)
    if proximal_logprobs is not None:
        _check_2d("proximal_logprobs", proximal_logprobs, shape)
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages must be [B] or [B, T] for logprobs {tuple(shape)}, got {tuple(advantages.shape)}"
        )
    if kind not in ("tis", "ppo"):
        raise ValueError(f"loss kind must be 'tis' or 'ppo', got {kind!r}")
    if not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if num_tokens is not None and num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")

    # untrained positions are replaced by zeros *before* any arithmetic, so a NaN/inf there cannot
    # leak into the loss or (through 0 · NaN in backward) into the gradient
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    logp = torch.where(loss_mask, logprobs.float(), zero)  # [B, T]
    behavior = torch.where(loss_mask, behavior_logprobs.float(), zero)
    adv = advantages.float() if advantages.dim() == 2 else advantages.float()[:, None].expand(shape)
    adv = torch.where(loss_mask, adv, zero)  # [B, T]
    n = int(loss_mask.sum())
    denom = float(num_tokens if num_tokens is not None else max(n, 1))

    if kind == "tis":
        log_w = logp.detach() - behavior  # log π_θ/μ
        w = log_w.exp().clamp(max=tis_cap)  # truncated at C (IMPALA's ρ̄)
        per_token = -w * adv * logp
        clipped = torch.zeros_like(loss_mask)
    else:
        prox = logp.detach() if proximal_logprobs is None else torch.where(loss_mask, proximal_logprobs.float(), zero)
        log_w = prox - behavior  # log π_prox/μ: the behavior correction
        w = log_w.exp().clamp(max=tis_cap)
        ratio = (logp - prox).exp()  # r = π_θ/π_prox
        unclipped = ratio * adv
        clipped_term = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
        # min(...) picks the clipped (constant) branch exactly when r has left [1−ε, 1+ε] in the
        # direction A favours: r > 1+ε with A > 0, or r < 1−ε with A < 0 — no gradient there
        per_token = -w * torch.minimum(unclipped, clipped_term)
        clipped = clipped_term.detach() < unclipped.detach()
    loss = torch.where(loss_mask, per_token, zero).sum() / denom

    with torch.no_grad():
        m = loss_mask
        k = max(n, 1)
        log_rho = logp - behavior  # log π_θ/μ
        k3 = log_rho.exp() - 1 - log_rho
        metrics = PolicyLossMetrics(
            is_weight_mean=float(w[m].sum()) / k,
            truncated_fraction=float((log_w[m].exp() > tis_cap).sum()) / k,
            clip_fraction=float(clipped[m].sum()) / k,
            approx_kl=float(k3[m].sum()) / k,
            tokens=n,
        )
    return loss, metrics
