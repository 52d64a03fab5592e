"""A level-triggered wake-up for anyio tasks: one idiom for "something changed, look again"."""

from __future__ import annotations

import anyio


class Wakeup:
    """:meth:`notify` wakes every task waiting in :meth:`wait` now; a later ``wait`` waits for the
    next notification. A waiter re-checks its condition after waking (a notification says only that
    something changed), so a notification that finds no waiter is never needed later."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()
