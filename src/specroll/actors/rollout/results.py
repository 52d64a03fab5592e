"""What the hub hands back to whoever submitted groups: finished groups, oldest first, and the
groups the retry rule dropped (``specroll/rl/group_retries.py``) — each delivered once. A mixin of
:class:`~specroll.actors.rollout.client.RolloutClient`, which owns the coordinator and the wake-ups."""

from __future__ import annotations

import anyio

from specroll.actors.rollout.peers import HubEvents
from specroll.rl.coordinator import Group, Lane, RolloutCoordinator
from specroll.rl.group_retries import DroppedGroup, GroupDropped


class GroupResults:
    """Finished and dropped groups (module docstring)."""

    coordinator: RolloutCoordinator
    _events: HubEvents

    async def next_finished(self, timeout: float | None = None, lane: Lane = "train") -> Group:
        """The oldest finished group of ``lane``, waiting for one if none is ready.

        Raises:
            GroupDropped: a group of ``lane`` was dropped and not yet reported (see :meth:`wait_finished`).
            TimeoutError: none finished within ``timeout`` seconds.
        """
        await self.wait_finished(1, timeout, lane)
        return self.coordinator.pop_finished(1, lane)[0]

    async def wait_finished(self, count: int, timeout: float | None = None, lane: Lane = "train") -> None:
        """Wait until at least ``count`` finished groups of ``lane`` are ready (none is taken).

        Raises:
            GroupDropped: fewer are ready and a group of ``lane`` was dropped (its failures past
                ``max_group_retries``; none of its samples kept): it is taken and reported in
                ``.dropped`` — once, so call again after submitting it again or skipping it. A count
                that includes it would otherwise never be reached.
            TimeoutError: fewer finished within ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            while self.coordinator.num_finished(lane) < count:
                if self.coordinator.num_dropped(lane):
                    raise GroupDropped(self.coordinator.pop_dropped(1, lane)[0])
                await self._events.finished.wait()  # also woken by a drop

    def pop_finished(self, limit: int | None = None, lane: Lane = "train") -> list[Group]:
        """Finished groups of ``lane`` ready now, oldest first, without waiting."""
        return self.coordinator.pop_finished(limit, lane)

    def pop_dropped(self, limit: int | None = None, lane: Lane = "train") -> list[DroppedGroup]:
        """Groups of ``lane`` dropped by the retry rule and not yet reported, oldest first, without
        waiting (a served request's group is reported to the server instead, ``on_drop``)."""
        return self.coordinator.pop_dropped(limit, lane)

    @property
    def num_finished(self) -> int:
        """Finished training groups not yet popped."""
        return self.coordinator.num_finished()

    @property
    def num_pending(self) -> int:
        """Training groups queued or in flight."""
        return self.coordinator.num_pending()
