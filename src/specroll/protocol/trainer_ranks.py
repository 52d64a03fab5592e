"""The trainer's rank channel: what rank 0 of a sharded trainer tells its other ranks to do.

Rank 0 hosts the rollout client and decides; ranks 1..N-1 hold their FSDP2 shards and follow
(``actors/trainer/ranks/follower.py``). A command is msgpack of one of these structs, set under a fresh
key of the ``torch.distributed`` store the ranks rendezvoused on (``actors/trainer/ranks/channel.py``):
a follower may wait minutes for the next one (rank 0 waits for rollouts) without a collective
pending, which would time out. The tensors a command needs (a step's batch) follow it by
``broadcast`` from rank 0; the state a command gathers comes back by the collectives of
``torch.distributed.checkpoint.state_dict``. Never pickle: a command is data, decoded strictly.

=================  ==========================================================================
command            every rank then
=================  ==========================================================================
``TrainStep``      receives the packed batch (two broadcasts) and runs ``train_step`` on its rows
``GatherWeights``  joins the gather of the full parameters (rank 0 publishes them)
``GatherState``    joins the gather of the full parameters and optimizer state (a checkpoint)
``Restore``        joins the broadcast of a checkpoint rank 0 read, into its shards
``Stop``           acknowledges it in the store, leaves the process group and exits 0
=================  ==========================================================================
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from specroll.protocol.wire import NonNegative, Positive, WireMessage, WireStruct


class BatchShape(WireStruct):
    """The sizes of a packed ``RolloutBatch`` (``rl/packing.py``): R rows of T tokens, S
    continuations of at most L tokens."""

    rows: Positive
    """R."""
    tokens: Positive
    """T: the longest packed row."""
    continuations: Positive
    """S: continuations (responses, or episodes' sequences after their prompt) over all rows."""
    response_tokens: Positive
    """L: the longest continuation (at least 1)."""


class TrainStep(WireMessage, tag="train_step"):
    """Train one GRPO step on the batch broadcast next, as policy version ``version``."""

    version: int
    shape: BatchShape
    threads: Positive
    """Torch intra-op threads for this step (rank 0's budget: borrowed cores included or not)."""


class GatherWeights(WireMessage, tag="gather_weights"):
    """Gather the full parameters on rank 0 (to publish them)."""


class GatherState(WireMessage, tag="gather_state"):
    """Gather the full parameters and optimizer state on rank 0 (to write a checkpoint)."""


class Restore(WireMessage, tag="restore"):
    """Load the checkpoint rank 0 broadcasts next into every rank's shards."""

    step: NonNegative
    """The checkpoint's step (for the followers' logs)."""
    with_optimizer: bool = False
    """Whether AdamW's state follows the weights (a checkpoint has none before the first step)."""


class Stop(WireMessage, tag="stop"):
    """The trainer is done (or failing): leave the process group and exit 0."""


RankCommand: TypeAlias = TrainStep | GatherWeights | GatherState | Restore | Stop

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankCommand)


def encode_command(command: RankCommand) -> bytes:
    """msgpack of ``command`` (tagged by its ``type``)."""
    return _encoder.encode(command)


def decode_command(data: bytes) -> RankCommand:
    """The command in ``data``.

    Raises:
        msgspec.DecodeError: not msgpack of a :data:`RankCommand` (``ValidationError``: a field
            of the wrong type or out of range).
    """
    return _decoder.decode(data)
