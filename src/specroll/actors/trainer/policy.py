"""The policy as the trainer uses it: train a step, hand out the full weights to publish, write a
checkpoint, close — on one rank, or driving the ranks of a sharded trainer.

* :class:`LocalPolicy` (``trainer.world_size = 1``): the model and AdamW in this process, no
  process group at all;
* :class:`RankZeroPolicy` (rank 0 of N): its own shards (:class:`~specroll.actors.trainer.ranks.sharded.ShardedModel`)
  plus a command to the other ranks before each operation (``rank_channel.py``), so every rank
  runs the same collectives in the same order. A lock keeps operations whole when callers overlap.

Every method blocks (run it in a worker thread from the event loop).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from specroll.actors.trainer.checkpoint import SavedCheckpoint, TrainerState, save_checkpoint, write_checkpoint
from specroll.actors.trainer.ranks.channel import RankChannel, batch_shape
from specroll.actors.trainer.ranks.sharded import ShardedModel
from specroll.engine.model import CausalLM
from specroll.engine.model_config import ModelConfig
from specroll.protocol.trainer_ranks import GatherState, GatherWeights, Restore, Stop, TrainStep
from specroll.rl.grpo_step import RolloutBatch, StepResult, StepSettings, train_step

log = logging.getLogger("specroll.trainer")

STOP_TIMEOUT_S = 30.0
"""How long rank 0 waits for the other ranks to read ``Stop`` before it leaves (and its store goes)."""


class Policy(Protocol):
    """What the trainer does with its policy (module docstring)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def world_size(self) -> int: ...

    def train(self, batch: RolloutBatch, version: int, before_phase: Callable[[], None] | None) -> StepResult:
        """One GRPO step on ``batch`` (``grpo_step.train_step``) trained as policy ``version``;
        ``before_phase`` sets the thread budget before each phase of the step."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full parameters under Hugging Face names (``CausalLM.hf_weights``' names)."""
        ...

    def save(self, run_dir: Path, state: TrainerState) -> Path:
        """Write ``run_dir/checkpoint/`` (``checkpoint.py``'s layout); returns its path."""
        ...

    def close(self, wait: bool = True) -> None:
        """Release the policy (a sharded one stops its other ranks, waiting until they heard it
        unless ``wait`` is false: the trainer is failing); idempotent."""
        ...


class LocalPolicy:
    """The whole policy in this process (``trainer.world_size = 1``).

    Args:
        model: the policy, on ``device``.
        optimizer: AdamW over its parameters.
        settings: the step's settings (``TrainerConfig``).
        device: where it trains (``trainer.device``).
    """

    world_size = 1

    def __init__(self, model: CausalLM, optimizer: torch.optim.Optimizer, settings: StepSettings,
                 device: torch.device) -> None:
        self.model, self.optimizer, self.settings, self.device = model, optimizer, settings, device

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def train(self, batch: RolloutBatch, version: int, before_phase: Callable[[], None] | None) -> StepResult:
        return train_step(self.model, self.optimizer, batch.to(self.device), version, self.settings,
                          before_phase)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Views of the parameters (they change with the next step; the client snapshots them)."""
        return self.model.hf_weights()

    def save(self, run_dir: Path, state: TrainerState) -> Path:
        return save_checkpoint(run_dir, self.model, self.optimizer, state)

    def close(self, wait: bool = True) -> None:
        pass


class RankZeroPolicy:
    """Rank 0 of a sharded trainer: each operation is a command to the other ranks, then this rank's
    part of it (module docstring).

    Args:
        sharded: this rank's shards.
        channel: the command channel to the other ranks.
        settings: the step's settings (``TrainerConfig``).
    """

    def __init__(self, sharded: ShardedModel, channel: RankChannel, settings: StepSettings) -> None:
        self.sharded, self.channel, self.settings = sharded, channel, settings
        self._lock = threading.Lock()
        self._closed = False

    @property
    def config(self) -> ModelConfig:
        return self.sharded.config

    @property
    def world_size(self) -> int:
        return self.sharded.ranks.world_size

    def restore(self, saved: SavedCheckpoint) -> None:
        """Load ``saved`` (read here) into every rank's shards."""
        with self._lock:
            with_optimizer = bool(saved.optimizer)
            self.channel.send(Restore(step=saved.state.step, with_optimizer=with_optimizer))
            self.sharded.restore(saved, with_optimizer)
            self.channel.finished()

    def train(self, batch: RolloutBatch, version: int, before_phase: Callable[[], None] | None) -> StepResult:
        """The step on every rank. The thread budget is decided once, for the whole step (the other
        ranks cannot see the generators), by one call of ``before_phase``."""
        if before_phase is not None:
            before_phase()
        threads, shape = torch.get_num_threads(), batch_shape(batch)
        with self._lock:
            self.channel.send(TrainStep(version=version, shape=shape, threads=threads))
            batch = self.channel.broadcast_batch(batch, shape)
            result = self.sharded.train(batch, version, self.settings, threads)
            self.channel.finished()
        return result

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Gathered from every rank: full CPU tensors of their own."""
        with self._lock:
            self.channel.send(GatherWeights())
            weights = self.sharded.gather_weights()
            self.channel.finished()
        return weights

    def save(self, run_dir: Path, state: TrainerState) -> Path:
        """Gather the full weights and AdamW state from every rank and write them here."""
        with self._lock:
            self.channel.send(GatherState())
            weights, optimizer = self.sharded.gather_state()
            self.channel.finished()
        return write_checkpoint(run_dir, weights, optimizer, state)

    def close(self, wait: bool = True) -> None:
        """Tell the other ranks to stop and leave the process group; with ``wait``, first wait (at
        most :data:`STOP_TIMEOUT_S`) until every other rank read ``Stop`` — on a clean end, so none
        finds this rank's store gone first and fails. A failing trainer does not wait: a rank may
        be dead, and the launcher restarts them all anyway."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.channel.send(Stop())
            stopped = self.channel.stop(STOP_TIMEOUT_S) if wait else self.world_size - 1
            if stopped < self.world_size - 1:
                log.warning("only %d of the %d other trainer ranks acknowledged Stop within %g s", stopped,
                            self.world_size - 1, STOP_TIMEOUT_S)
            dist.destroy_process_group()
