"""Rank 0 → the other trainer ranks: commands (``protocol/trainer_ranks.py``) over the
``torch.distributed`` store the ranks share, a step's batch by ``broadcast``.

Why the store and not a broadcast for the commands: a follower waits for the next command as long
as rank 0 waits for rollouts — minutes, possibly — and a collective left pending that long times out
(gloo after the group's timeout, NCCL's watchdog sooner). A blocking ``store.get`` of the next key
waits with nothing pending and fails at once when rank 0's store goes away (its process died). Each
command is set under a key of its own (``specroll/trainer/command/<seq>``); rank 0 deletes a key once
the command's collectives finished on it, which every follower can only have joined after reading it.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from specroll.protocol.trainer_ranks import BatchShape, RankCommand, decode_command, encode_command
from specroll.rl.packing import RolloutBatch

KEY_PREFIX = "specroll/trainer/command/"
STOPPED_KEY = "specroll/trainer/stopped"
WAIT_FOR_COMMAND = datetime.timedelta(days=30)
"""How long a follower waits for rank 0's next command: unbounded in practice (a dead rank 0 ends
the wait at once)."""


class RankChannel:
    """Commands from rank 0 and the batch broadcast that follows a ``TrainStep``.

    Args:
        store: the store every rank rendezvoused on (``ranks.join_group``).
        rank: this process's rank (of ``world_size``).
        device: where the batch tensors are broadcast (the rank's training device: NCCL needs CUDA).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
        self.store, self.rank, self.world_size, self.device = store, rank, world_size, device
        self._seq = 0
        if rank > 0:
            store.set_timeout(WAIT_FOR_COMMAND)

    def send(self, command: RankCommand) -> None:
        """Rank 0: publish the next command to every other rank."""
        assert self.rank == 0, "only rank 0 sends commands"
        self.store.set(f"{KEY_PREFIX}{self._seq}", encode_command(command))

    def finished(self) -> None:
        """Rank 0: the command sent last completed its collectives here (every rank has read it)."""
        self.store.delete_key(f"{KEY_PREFIX}{self._seq}")
        self._seq += 1

    def receive(self) -> RankCommand:
        """Rank > 0: wait for rank 0's next command.

        Raises:
            torch.distributed.DistNetworkError: rank 0's store is gone (rank 0 died).
            msgspec.DecodeError: the bytes are not a command (a different specroll version?).
        """
        assert self.rank > 0, "rank 0 sends commands"
        data = self.store.get(f"{KEY_PREFIX}{self._seq}")
        self._seq += 1
        return decode_command(data)

    def stop(self, timeout_s: float) -> int:
        """Rank 0, after sending ``Stop``: wait (at most ``timeout_s``) until every other rank read it,
        so none finds rank 0's store gone and fails; returns how many did."""
        deadline = time.monotonic() + timeout_s
        while (stopped := self.store.add(STOPPED_KEY, 0)) < self.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return stopped

    def acknowledge_stop(self) -> None:
        """Rank > 0: ``Stop`` was read (what :meth:`stop` waits for)."""
        self.store.add(STOPPED_KEY, 1)

    def broadcast_batch(self, batch: RolloutBatch | None, shape: BatchShape) -> RolloutBatch:
        """Rank 0 sends ``batch`` (of ``shape``), every other rank passes None and gets it: two
        broadcasts, the int64 tensors in one and the float32 ones in the other."""
        g, t, b, length = shape.rows, shape.tokens, shape.continuations, shape.response_tokens
        int_sizes = [g * t, g * t, g * t, g, g + 1, b * length, b * length, b * length, b * length]
        float_sizes = [b * length, b]
        if batch is not None:
            ints = torch.cat([batch.input_ids.flatten(), batch.positions.flatten(), batch.segments.flatten(),
                              batch.row_lengths, batch.row_starts, batch.predecessor.flatten(), batch.targets.flatten(),
                              batch.loss_mask.flatten().long(), batch.versions.flatten()]).to(self.device)  # [sum]
            floats = torch.cat([batch.behavior_logprobs.flatten(), batch.advantages]).float().to(self.device)
        else:
            ints = torch.empty(sum(int_sizes), dtype=torch.int64, device=self.device)
            floats = torch.empty(sum(float_sizes), dtype=torch.float32, device=self.device)
        assert ints.numel() == sum(int_sizes) and floats.numel() == sum(float_sizes), "batch and shape disagree"
        dist.broadcast(ints, src=0)
        dist.broadcast(floats, src=0)
        ids, pos, seg, lengths, starts, pred, targets, mask, versions = ints.split(int_sizes)
        behavior, advantages = floats.split(float_sizes)
        return RolloutBatch(
            input_ids=ids.view(g, t), positions=pos.view(g, t), segments=seg.view(g, t), row_lengths=lengths,
            row_starts=starts, predecessor=pred.view(b, length), targets=targets.view(b, length),
            loss_mask=mask.view(b, length).bool(), behavior_logprobs=behavior.view(b, length),
            versions=versions.view(b, length), advantages=advantages)


def batch_shape(batch: RolloutBatch) -> BatchShape:
    """The sizes of ``batch`` as a command carries them."""
    rows, tokens = batch.input_ids.shape
    return BatchShape(rows=rows, tokens=tokens, continuations=batch.targets.shape[0],
                      response_tokens=batch.targets.shape[1])
