"""The hub's clock: the task that hands queued groups to generators with free capacity, declares
silent or disconnected peers gone and tells drafter trainers the generators' load.

Groups are also dispatched as soon as something frees capacity (a group finished, a generator
registered or is gone: :meth:`Ticker.dispatch` is what the receiver and the peers call); the tick
catches what no message announced.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from specroll.actors.rollout.outboxes import Send
from specroll.actors.rollout.peers import Peers
from specroll.actors.rollout.timeline import Timeline
from specroll.rl.coordinator import RolloutCoordinator

TICK_S = 0.05
"""Seconds between ticks (dispatch and liveness)."""

LOAD_REPORT_S = 0.5
"""Seconds between reports of the generators' load to drafter trainers."""


class Ticker:
    """Dispatches groups and runs the hub's periodic work.

    Args:
        coordinator: decides which queued group goes to which generator.
        send: queues a message for a peer.
        timeline: records every resumed group (``group_resumed``); None records nothing.
        closing: true once the hub is closing: nothing new goes to generators about to get ``Dead``.
    """

    def __init__(self, coordinator: RolloutCoordinator, send: Send, timeline: Timeline | None,
                 closing: Callable[[], bool]) -> None:
        self.coordinator, self._send, self.timeline, self._closing = coordinator, send, timeline, closing

    def dispatch(self) -> None:
        """Send every queued group that fits on a generator to it (a resumed one with the tokens held)."""
        if self._closing():
            return  # nothing new for generators about to get Dead
        for actor, msg in self.coordinator.dispatch():
            if msg.resume and self.timeline is not None:
                self.timeline.record("group_resumed", group_id=msg.group_id, actor=actor,
                                     held={r.index: r.token_ids for r in msg.resume})
            self._send(actor, msg, None)

    async def run(self, peers: Peers) -> None:
        """Tick until cancelled: every :data:`LOAD_REPORT_S` tell drafter trainers the load; every
        :data:`TICK_S` expire gone peers and dispatch."""
        last_capacity = 0.0
        while True:
            now = time.monotonic()
            if now - last_capacity >= LOAD_REPORT_S:
                last_capacity = now
                peers.tell_drafters_the_load()
            peers.expire(now)
            self.dispatch()
            await anyio.sleep(TICK_S)
