"""Group ids across incarnations of a client on one endpoint, and the chunks of groups this client
never issued.

Group ids must not repeat across incarnations: generators that outlived a crashed client still run
its groups ("g0", "g1", ...), and a new group reusing such an id would be refused by the generator
("already live") or merged with the old one's chunks. Numbering from the start time in µs makes
every id of this incarnation larger than any id of an earlier one (unless it issued more than a
group per µs), so chunks of older groups are recognised as foreign; the client aborts each such
group on the generator that runs it, once.

A generator can also stream a group of this client's that it no longer serves: one declared dead
(silent past the heartbeat timeout, e.g. stopped by SIGSTOP) whose groups resumed elsewhere, and
which then comes back, registers again and goes on decoding its old groups. Those chunks are
stale: they reach neither the coordinator nor the client's ``on_chunk``, and the group is aborted
on that generator, once, like a foreign one.
"""

from __future__ import annotations

import time

from specroll.rl.coordinator import RolloutCoordinator

MAX_REMEMBERED = 4096
"""(generator, group) pairs remembered as aborted; beyond, the oldest is forgotten."""


class ForeignGroups:
    """Recognises groups ``coordinator`` never issued, and chunks from a generator that no longer
    serves their group; makes ``coordinator`` number its groups from now in µs.

    Args:
        coordinator: the client's coordinator, before it issued any group.
    """

    def __init__(self, coordinator: RolloutCoordinator) -> None:
        self.coordinator = coordinator
        self.first = time.time_ns() // 1000
        """Number of this incarnation's first group id."""
        coordinator._next_id = self.first
        self._aborted: dict[tuple[str, str], None] = {}  # insertion-ordered: the oldest first

    def is_foreign(self, group_id: str) -> bool:
        """True for a group this client never issued (e.g. one of a crashed earlier incarnation)."""
        if group_id in self.coordinator.groups:
            return False
        number = group_id[1:]  # ASCII digits (int() refuses "²"), at most 19 (int() of 4300 or more raises)
        return not (group_id[:1] == "g" and number.isascii() and number.isdigit() and len(number) <= 19
                    and self.first <= int(number) < self.coordinator._next_id)

    def stale(self, actor: str, group_id: str) -> str | None:
        """Why a chunk of ``group_id`` from ``actor`` is not to be merged, or None when ``actor``
        serves that group now."""
        if self.is_foreign(group_id):
            return "unknown here (an earlier client's?)"
        group = self.coordinator.groups.get(group_id)
        if group is None:
            return "which is no longer live here (finished or aborted)"
        if group.generator != actor:
            return f"which {actor} no longer serves (it resumed on {group.generator or 'no generator yet'})"
        return None

    def first_stale_chunk(self, actor: str, group_id: str) -> bool:
        """Count a stale chunk of ``group_id`` (see :meth:`stale`) as ignored; True the first time
        ``actor`` streams it and it was not aborted there already (:meth:`aborted`): it should be
        aborted now, and its final ``abort`` chunks are then ignored."""
        self.coordinator.ignored_chunks += 1
        return self.aborted(actor, group_id)

    def aborted(self, actor: str, group_id: str) -> bool:
        """Remember that ``group_id`` is (to be) aborted on ``actor``; False if it was already. At
        most :data:`MAX_REMEMBERED` pairs are remembered (oldest forgotten first), so a peer
        inventing group ids cannot grow this without bound; a forgotten pair is aborted again."""
        key = (actor, group_id)
        if key in self._aborted:
            return False
        self._aborted[key] = None
        if len(self._aborted) > MAX_REMEMBERED:
            del self._aborted[next(iter(self._aborted))]
        return True
