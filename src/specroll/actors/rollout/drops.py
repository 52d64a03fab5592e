"""What the hub does when its coordinator drops a group that kept failing (the retry rule,
``specroll/rl/group_retries.py``): a log line naming the group, its prompt and its last failure; a
``group_dropped`` timeline event; its waiters woken (``RolloutClient.next_finished`` and
``wait_finished`` raise :class:`~specroll.rl.group_retries.GroupDropped` for a dropped group of the
lane they wait on); and the hub's ``on_drop`` callback (the HTTP server's router ends the request of
a dropped served group with it)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from specroll.actors.rollout.peers import HubEvents
from specroll.actors.rollout.timeline import Timeline
from specroll.rl.groups import Group
from specroll.rl.tasks import Prompt

log = logging.getLogger("specroll.client")


class DropNotice:
    """Called by the coordinator with each group it drops (module docstring).

    Args:
        events: the hub's wake-ups (``finished`` is notified).
        timeline: where ``group_dropped`` is recorded (None: nowhere).
    """

    def __init__(self, events: HubEvents, timeline: Timeline | None) -> None:
        self.events, self.timeline = events, timeline
        self.on_drop: Callable[[Group], None] | None = None
        """Called with every dropped group (:attr:`~specroll.rl.groups.Group.dropped` set), any lane."""

    def __call__(self, group: Group) -> None:
        dropped = group.dropped
        assert dropped is not None, "the coordinator sets it before it calls"
        prompt = f" (prompt {group.payload.prompt_id})" if isinstance(group.payload, Prompt) else ""
        log.warning("%s%s: none of its samples is kept", dropped.describe(), prompt)
        if self.timeline is not None:
            self.timeline.record("group_dropped", group_id=group.group_id, lane=group.lane, reason=dropped.reason,
                                 failures=dropped.failures)
        self.events.finished.notify()
        if self.on_drop is not None:
            self.on_drop(group)
