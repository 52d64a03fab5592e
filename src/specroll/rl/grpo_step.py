"""One GRPO training step on a packed batch: the staleness bound and the update.

Synchronous torch code with no I/O, called by the trainer actor in a worker thread:

* the batch is packed by ``rl/packing.py`` (:func:`build_batch` for single-turn groups: each row a
  group's prompt once, then its n responses, each attending to the prompt and to itself only) or
  ``rl/episodes.py`` (multi-turn episodes: the environment's tokens in the rows, out of the loss);
  per continuation, its tokens with their loss mask, behavior logprob and policy version
  (``rl/grpo.py``'s layout: entry ``[s, j]`` describes token ``j`` of continuation ``s``);
* :func:`train_step` enforces the staleness bound η per token, runs the differentiable forward
  (``CausalLM.hidden_dense``, in bf16 under autocast with ``trainer.precision = "bf16"``) over
  micro-batches of whole rows, runs the LM head only where a trained token is predicted and a
  chunk of tokens at a time (``engine/head_logprobs.py``), accumulates the gradient of the
  off-policy-corrected token-level loss (one token mean over the whole step), clips the global
  gradient norm and takes one fused AdamW step (:func:`policy_optimizer`; none when the bound left
  no token in the loss: the batch is skipped). On the way it measures the training–inference
  mismatch (:class:`Mismatch`): the trainer's own logprob of every lag-0 token against the behavior
  logprob the generator recorded for it.

Running the prompt once per row instead of n times, and the LM head (a fifth of SmolLM2-135M's
compute) only at trained positions: for the default task (a ~45-token prompt, 8 responses of ~30
tokens) that halves the tokens a step runs through the model.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from specroll.engine.device import training_precision
from specroll.engine.model import CausalLM
from specroll.rl.grpo import apply_staleness, policy_loss
from specroll.rl.packing import RolloutBatch, build_batch
from specroll.rl.step_result import Mismatch, Precision, StepResult, StepSettings

__all__ = ["Mismatch", "RolloutBatch", "StepResult", "StepSettings", "build_batch", "policy_optimizer",
           "precision_context", "response_logprobs", "train_step"]


def response_logprobs(model: CausalLM, batch: RolloutBatch, rows: torch.Tensor, head_chunk: int = 0) -> torch.Tensor:
    """The policy's logprob of every trained token of the continuations of ``rows``: float32 ``[s, L]``
    over ``batch.continuations_of(rows)`` (0 where ``loss_mask`` is False), differentiable in the
    model's parameters. The LM head runs at trained positions only, ``head_chunk`` tokens at a time
    (``CausalLM.logprobs_at``; 0: all at once); under autocast (``trainer.precision = "bf16"``) its
    matmuls and the decoder's run in bf16."""
    device = batch.input_ids.device
    t = int(batch.row_lengths[rows].max())  # trim the micro-batch to its own longest row
    samples, local = batch.continuations_of(rows)  # [s] each
    real = batch.loss_mask[samples]  # [s, L]
    local_row = local[:, None].expand_as(real)  # [s, L]
    lp = model.logprobs_at(batch.input_ids[rows, :t], batch.positions[rows, :t], batch.attention_mask(rows, t),
                           local_row[real], batch.predecessor[samples][real], batch.targets[samples][real],
                           head_chunk)  # [N]
    return torch.zeros(real.shape, dtype=torch.float32, device=device).masked_scatter(real, lp)  # [s, L]


def precision_context(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Where the step's forward runs: ``bf16`` is autocast to bfloat16 on ``device`` (matmuls and
    attention in bf16, the float32 parameters as master weights, the log-softmax in float32 —
    ``engine/head_logprobs.py``); ``fp32`` changes nothing (the parameters' own dtype); ``auto`` is
    :func:`~specroll.engine.device.training_precision` of ``device``.
    Mixed-precision training: Micikevicius et al. 2018, "Mixed Precision Training"; bf16 needs no
    loss scaling (Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training")."""
    if training_precision(precision, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def policy_optimizer(params: Iterable[torch.nn.Parameter], learning_rate: float,
                     weight_decay: float) -> torch.optim.AdamW:
    """The trainer's AdamW (Loshchilov & Hutter 2019, decoupled weight decay) with torch's fused
    kernel: one pass over all parameters instead of a loop of small ops per tensor — on a 2-core
    CPU with SmolLM2-135M's 135M float32 parameters, 0.20 s a step instead of 0.90 s
    (``benchmarks/bench_train_step.py``, phase ``optimizer``). The same update, state and state dict
    as the unfused one, so checkpoints load either way; its state stays float32 with float32
    parameters (``trainer.precision = "bf16"`` keeps them the master weights)."""
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=True)


def train_step(
    model: CausalLM, optimizer: torch.optim.Optimizer, batch: RolloutBatch, current_version: int,
    config: StepSettings, before_phase: Callable[[], None] | None = None, *, rank: int = 0,
    world_size: int = 1,
) -> StepResult:
    """One optimizer step of GRPO on ``batch``, trained as policy version ``current_version``.

    Tokens lagging more than η = ``config.max_staleness`` versions leave the loss (``mask``) or take
    their sample with them (``drop``) — ``grpo.apply_staleness``. The token-level mean spans the
    whole step (N = trained tokens of all micro-batches), so accumulating over ``grad_accum_steps``
    micro-batches (of whole rows: at most R of them) gives the gradient of one large batch. A
    batch with no token left in the loss is skipped (:attr:`StepResult.skipped`): no forward, no
    optimizer step, no mismatch measured — an AdamW step on zero gradients would still move the
    weights (decoupled weight decay, and the momentum of earlier steps) without training on anything.
    A batch whose tokens all have zero advantage does step: that is GRPO's update for it.
    ``before_phase`` is called before each phase — each micro-batch's forward and its backward, and
    the optimizer step — where the trainer sets its thread budget (``actors/trainer/thread_budget.py``).
    The forward runs under ``config.precision`` (:func:`precision_context`), the LM head
    ``config.head_chunk`` tokens at a time.

    Sharded (``world_size`` > 1, inside a ``torch.distributed`` process group whose every rank calls
    this with the same ``batch``; the model sharded with FSDP2 summing, not averaging, gradients:
    ``actors/trainer/ranks/sharded.py``): rank r trains its contiguous share of the R rows
    (``tensor_split``), in ``min(grad_accum_steps, ⌈R / world_size⌉)`` micro-batches on every rank —
    FSDP's collectives need the same number of forward/backward passes everywhere, so a rank out of
    rows runs a pass with an empty loss mask (a zero loss that still backpropagates). N is the whole
    batch's, so the summed gradient is the one-rank gradient; the loss diagnostics and the mismatch
    are summed over ranks (``all_reduce``), so every rank returns the one-rank result (up to the
    order of float additions).

    Raises:
        ValueError: a trained token newer than ``current_version`` (from ``apply_staleness``), or
            ``rank`` not in ``[0, world_size)``.
        FloatingPointError: the gradient norm is not finite (nothing is updated).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, expected an integer in [0, world_size = {world_size})")
    mask, masked, dropped = apply_staleness(batch.loss_mask, batch.versions, current_version,
                                            config.max_staleness, config.staleness_policy)
    total = int(mask.sum())
    if total == 0:
        return StepResult(loss=0.0, is_weight_mean=0.0, truncated_fraction=0.0, clip_fraction=0.0, approx_kl=0.0,
                          grad_norm=0.0, trained_tokens=0, tokens_masked_stale=masked, samples_dropped_stale=dropped)
    lags = Counter((current_version - batch.versions[mask]).tolist())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    sums = dict.fromkeys(("is_weight_mean", "truncated_fraction", "clip_fraction", "approx_kl"), 0.0)
    loss_sum = 0.0
    lag0 = batch.loss_mask & (batch.versions == current_version)  # [B, L]: sampled by the weights trained now
    mismatch = Mismatch()
    num_rows = batch.input_ids.shape[0]
    device = batch.input_ids.device
    share = torch.arange(num_rows, device=device).tensor_split(world_size)[rank]  # this rank's rows
    passes = min(config.grad_accum_steps, -(-num_rows // world_size))
    for rows in share.tensor_split(passes):
        _call(before_phase)
        idle = len(rows) == 0  # a sharded rank out of rows: the same passes as the others, nothing trained
        rows = torch.zeros(1, dtype=torch.int64, device=device) if idle else rows  # [g]
        samples, _ = batch.continuations_of(rows)  # [s]
        with precision_context(config.precision, device):
            logprobs = response_logprobs(model, batch, rows, config.head_chunk)  # [s, L]
        trained, fresh = mask[samples], lag0[samples]  # [s, L] each
        if idle:
            trained, fresh = torch.zeros_like(trained), torch.zeros_like(fresh)
        mismatch.add(logprobs.detach()[fresh], batch.behavior_logprobs[samples][fresh])
        loss, m = policy_loss(logprobs, batch.behavior_logprobs[samples], batch.advantages[samples], trained,
                              kind=config.loss, tis_cap=config.tis_cap, clip_eps=config.clip_eps,
                              num_tokens=total)
        _call(before_phase)
        loss.backward()
        loss_sum += float(loss.detach())
        for key in sums:  # token-weighted, so the step's figure is the mean over all its tokens
            sums[key] += m[key] * m["tokens"]  # type: ignore[literal-required]
    if world_size > 1:
        loss_sum, sums, mismatch = _sum_over_ranks(loss_sum, sums, mismatch, device)
    _call(before_phase)
    norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm or math.inf)
    grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded: a replicated DTensor
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"gradient norm is {grad_norm} at policy version {current_version}; "
                                 "no update taken (lower trainer.learning_rate?)")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss_sum, grad_norm=grad_norm, trained_tokens=total, tokens_masked_stale=masked,
                      samples_dropped_stale=dropped, staleness=dict(sorted(lags.items())), mismatch=mismatch,
                      **{key: value / total for key, value in sums.items()})


def _call(hook: Callable[[], None] | None) -> None:
    if hook is not None:
        hook()


def _sum_over_ranks(loss_sum: float, sums: dict[str, float], mismatch: Mismatch,
                    device: torch.device) -> tuple[float, dict[str, float], Mismatch]:
    """The step's loss, token-weighted diagnostics and mismatch over every rank of the default
    process group: sums (float64) and the largest |d|."""
    tokens, abs_sum, k3_sum, abs_max = mismatch.sums()
    added = torch.tensor([loss_sum, *sums.values(), tokens, abs_sum, k3_sum], dtype=torch.float64,
                         device=device)  # [len(sums) + 4]
    largest = torch.tensor([abs_max], dtype=torch.float64, device=device)  # [1]
    dist.all_reduce(added, op=dist.ReduceOp.SUM)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    values = added.tolist()
    total_sums = dict(zip(sums, values[1 : 1 + len(sums)], strict=True))
    return values[0], total_sums, Mismatch.from_sums(*values[1 + len(sums) :], largest.item())
