"""``X-Session-ID`` pins: which generator a session's last request ran on, so its next turn goes
there too and reuses that generator's prefix cache (the turns share their prompt's beginning).

Bounded: at most ``max_sessions`` pins, each forgotten ``ttl_s`` seconds after its last use (the least
recently used goes first when full). A pin is only a preference: the coordinator sends a pinned
request elsewhere once its generator is gone (:attr:`specroll.rl.coordinator.Group.pin`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_SESSION_ID_CHARS = 256
"""Longest ``X-Session-ID`` accepted (a longer one is a 400)."""


class Sessions:
    """Session id → generator actor id, least recently used first.

    Args:
        max_sessions: most pins held.
        ttl_s: seconds a pin lives after its last :meth:`get` or :meth:`record`.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions, self.ttl_s, self._clock = max_sessions, ttl_s, clock
        self._pins: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.hits = 0
        """Requests whose session had a live pin."""
        self.misses = 0
        """Requests with a session id and no live pin (a new session, or one forgotten)."""

    def get(self, session_id: str) -> str | None:
        """The generator ``session_id`` last ran on, or None (unknown or expired)."""
        self._expire()
        pin = self._pins.get(session_id)
        if pin is None:
            self.misses += 1
            return None
        self.hits += 1
        self._pins[session_id] = (pin[0], self._clock())
        self._pins.move_to_end(session_id)
        return pin[0]

    def record(self, session_id: str, generator: str) -> None:
        """``session_id``'s request ran on ``generator``: pin it there."""
        self._pins[session_id] = (generator, self._clock())
        self._pins.move_to_end(session_id)
        while len(self._pins) > self.max_sessions:
            self._pins.popitem(last=False)

    def __len__(self) -> int:
        self._expire()
        return len(self._pins)

    def _expire(self) -> None:
        oldest = self._clock() - self.ttl_s
        while self._pins and next(iter(self._pins.values()))[1] < oldest:
            self._pins.popitem(last=False)
