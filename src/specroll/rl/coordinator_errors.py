"""The rollout coordinator's errors: a chunk it cannot merge, a group past its queue's capacity."""

from __future__ import annotations

from specroll.protocol.limits import MAX_ID_CHARS
from specroll.protocol.messages import RolloutChunk


class ChunkError(ValueError):
    """A rollout chunk that cannot be merged: unknown group or sample, a gap, a disagreement with
    tokens already held, tokens after the sample finished or beyond its ``max_tokens``, or a group
    id longer than :data:`~specroll.protocol.limits.MAX_ID_CHARS`."""


class QueueFull(RuntimeError):
    """A group submitted while ``max_queued_groups`` groups wait for a generator: nothing was queued.
    Submit it again once groups were dispatched (a generator reported room, or groups finished).

    Attributes:
        capacity: ``max_queued_groups``.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(f"{capacity} groups are queued for a generator, the rollout coordinator's capacity "
                         f"(max_queued_groups = {capacity}; trainer.max_queued_groups in a run's config): nothing "
                         "was queued; submit again once groups were dispatched")
        self.capacity = capacity


def check_chunk_group_id(chunk: RolloutChunk) -> None:
    """Bound the chunk's group id before it is looked up or parsed anywhere.

    Raises:
        ChunkError: an id longer than :data:`~specroll.protocol.limits.MAX_ID_CHARS`.
    """
    if len(chunk.group_id) > MAX_ID_CHARS:
        raise ChunkError(f"RolloutChunk.len(group_id) = {len(chunk.group_id)} is over the limit {MAX_ID_CHARS} "
                         "(protocol limit)")
