"""The policy sharded over the trainer's ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``),
as every rank holds it — rank 0 drives it (``policy.py``), the others follow (``follower.py``).

FSDP2 on both devices: NCCL on CUDA, and gloo on the CPU, which torch 2.13 supports for FSDP2's
all-gather and reduce-scatter (so there is no DDP fallback). Each decoder layer is one FSDP unit
and the root (embedding, final norm, LM head) another. The GRPO step's forward is not ``forward``
(the paged inference path) but ``CausalLM.logprobs_at`` on the root and ``DecoderLayer.forward_dense``
on the layers, registered with ``register_fsdp_forward_method`` so FSDP's hooks gather each unit's
parameters around them — the LM head's weight (the embedding, when tied) is used inside
``logprobs_at``, so it is gathered there.

Gradients are summed over ranks, not averaged: every rank's loss already divides by the whole
step's token count (``grpo_step.train_step``), so the sum is the one-rank gradient
(``set_gradient_divide_factor(1.0)``, with SUM-only collectives: gloo has no PREMUL_SUM). The
optimizer is AdamW over the shards; ``clip_grad_norm_`` on the sharded gradients (DTensors)
computes the global norm.

Full weights and state are gathered on rank 0 with ``torch.distributed.checkpoint.state_dict``
(``full_state_dict=True, cpu_offload=True``: rank 0 gets CPU tensors, the others nothing) and a
checkpoint is restored by broadcasting rank 0's full tensors into every rank's shards
(``broadcast_from_rank0=True``): only rank 0 reads ``RUN_DIR``, so ranks on other hosts need no
shared filesystem.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from specroll.actors.trainer.checkpoint import SavedCheckpoint
from specroll.actors.trainer.ranks.join import Ranks
from specroll.engine.model import CausalLM, fuse_weights, unfuse_weights
from specroll.rl.grpo_step import RolloutBatch, StepResult, StepSettings, policy_optimizer, train_step

GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Full tensors on rank 0's CPU, nothing on the other ranks."""
SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
"""Rank 0's full tensors broadcast into every rank's shards (the others pass empty dicts)."""


def shard_model(model: CausalLM, ranks: Ranks, device: torch.device) -> None:
    """Shard ``model`` (on ``device`` already) in place over the default process group: each decoder
    layer, then the root, with summed gradients (module docstring)."""
    mesh = init_device_mesh(device.type, (ranks.world_size,))
    units: list[FSDPModule] = []
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
        register_fsdp_forward_method(layer, "forward_dense")
        units.append(layer)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "logprobs_at")
    units.append(model)  # type: ignore[arg-type]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


class ShardedModel:
    """One rank's shards of the policy and of AdamW's state, and the collective operations every
    rank runs together (rank 0 gets the gathered results, the other ranks empty ones).

    Args:
        model: the full policy, loaded on every rank from the same weights; sharded here.
        ranks: this rank.
        device: its training device.
        learning_rate, weight_decay: AdamW's (``trainer.*``).
        threads: the torch intra-op threads it trains with between steps (``trainer.train_threads``).
    """

    def __init__(self, model: CausalLM, ranks: Ranks, device: torch.device, learning_rate: float,
                 weight_decay: float, threads: int) -> None:
        self.ranks, self.device, self.threads = ranks, device, threads
        self.config = model.config
        model.to(device)
        shard_model(model, ranks, device)
        self.model = model
        self.optimizer = policy_optimizer(model.parameters(), learning_rate, weight_decay)

    def train(self, batch: RolloutBatch, version: int, settings: StepSettings, threads: int,
              before_phase: Callable[[], None] | None = None) -> StepResult:
        """One GRPO step on this rank's share of ``batch`` (every rank holds the whole batch), with
        ``threads`` torch threads; every rank returns the step's whole result."""
        torch.set_num_threads(threads)
        try:
            return train_step(self.model, self.optimizer, batch.to(self.device), version, settings,
                              before_phase, rank=self.ranks.rank, world_size=self.ranks.world_size)
        finally:
            torch.set_num_threads(self.threads)

    def gather_weights(self) -> dict[str, torch.Tensor]:
        """The full parameters under Hugging Face names, on rank 0's CPU; ``{}`` on other ranks."""
        full = get_model_state_dict(self.model, options=GATHER)
        return unfuse_weights(self.config, full) if full else {}

    def gather_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What a checkpoint holds (``checkpoint.write_checkpoint``), on rank 0's CPU: the full
        parameters under Hugging Face names and AdamW's full state as ``"{parameter}/{key}"``; two
        empty dicts on the other ranks."""
        weights = self.gather_weights()
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=GATHER)
        if not weights:
            return {}, {}
        state = {f"{name}/{key}": value for name, fields in optimizer["state"].items() for key, value in fields.items()}
        return weights, state

    def restore(self, saved: SavedCheckpoint | None, with_optimizer: bool) -> None:
        """Load the checkpoint rank 0 read (``saved``; None on the other ranks) into every rank's
        shards: the weights, and AdamW's state when ``with_optimizer`` (every rank must pass the same)."""
        dtype = next(self.model.parameters()).dtype
        weights: dict[str, torch.Tensor] = {}
        optimizer: dict[str, object] = {}
        if saved is not None:
            weights = {name: t.to(dtype) for name, t in fuse_weights(self.config, saved.weights).items()}
            names = [name for name, _ in self.model.named_parameters()]
            hyper = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
            optimizer = {"state": saved.optimizer, "param_groups": [{**hyper, "params": names}]}
        set_model_state_dict(self.model, weights, options=SCATTER)
        if with_optimizer:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=SCATTER)  # type: ignore[arg-type]
