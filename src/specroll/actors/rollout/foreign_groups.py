"""Group ids across incarnations of a client on one endpoint, and the chunks of groups this client
never issued.

Group ids must not repeat across incarnations: generators that outlived a crashed client still run
its groups ("g0", "g1", ...), and a new group reusing such an id would be refused by the generator
("already live") or merged with the old one's chunks. Numbering from the start time in µs makes
every id of this incarnation larger than any id of an earlier one (unless it issued more than a
group per µs), so chunks of older groups are recognised as foreign; the client aborts each such
group on the generator that runs it, once.
"""

from __future__ import annotations

import time

from specroll.rl.coordinator import RolloutCoordinator


class ForeignGroups:
    """Recognises groups ``coordinator`` never issued; makes it number its groups from now in µs.

    Args:
        coordinator: the client's coordinator, before it issued any group.
    """

    def __init__(self, coordinator: RolloutCoordinator) -> None:
        self.coordinator = coordinator
        self.first = time.time_ns() // 1000
        """Number of this incarnation's first group id."""
        coordinator._next_id = self.first
        self._aborted: set[tuple[str, str]] = set()

    def is_foreign(self, group_id: str) -> bool:
        """True for a group this client never issued (e.g. one of a crashed earlier incarnation)."""
        if group_id in self.coordinator.groups:
            return False
        number = group_id[1:]  # ASCII digits (int() refuses "²"), at most 19 (int() of 4300 or more raises)
        return not (group_id[:1] == "g" and number.isascii() and number.isdigit() and len(number) <= 19
                    and self.first <= int(number) < self.coordinator._next_id)

    def first_chunk(self, actor: str, group_id: str) -> bool:
        """Count a chunk of foreign ``group_id`` as ignored; True the first time ``actor`` streams
        it (when it should be aborted: its final ``abort`` chunks are then ignored)."""
        self.coordinator.ignored_chunks += 1
        if (actor, group_id) in self._aborted:
            return False
        self._aborted.add((actor, group_id))
        return True
