"""The trainer's supply of groups: the feeder task that submits them and the wait for a finished batch.

The feeder submits groups (``client.submit``, prompts in a seeded cyclic order: ``prompt_cycle.py``)
while ``groups queued + in flight + finished but not yet trained`` is below
``trainer.max_groups_in_flight`` and, AReaL's staleness control (``specroll/rl/admission.py``), the
groups submitted and not through a finished step — the one being trained included — are fewer than
``(trainer.max_staleness + 1) × batch_groups``; it warns at start when ``max_groups_in_flight`` is
above that. In ``trainer.mode = "sync"`` there is no feeder task: each step submits its own
``batch_groups`` groups (:meth:`Feeder.submit_batch`).

Every training group submitted and not yet trained is remembered with its position in the prompt
order (:attr:`Feeder.untrained`): a step trains its batch in submission order, and a checkpoint saves
those positions, so a restarted trainer submits them again.

A group the hub dropped (its samples refused or lost past ``trainer.max_group_retries``,
``specroll/rl/group_retries.py``) is taken out of all of this while the feeder waits for a batch
(:class:`~specroll.actors.trainer.group_drops.GroupDrops`: logged, counted, its prompt skipped or
served again); in sync mode a group is submitted in its place, as the step still needs its batch.
"""

from __future__ import annotations

import logging

import anyio
import msgspec

from specroll.actors.config import RunConfig
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.shared.wakeup import Wakeup
from specroll.actors.trainer.generator_watch import GeneratorWatch
from specroll.actors.trainer.group_drops import GroupDrops
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.rl.admission import Admission, run_ahead_warning
from specroll.rl.coordinator import Group
from specroll.rl.group_retries import DroppedGroup, GroupDropped
from specroll.rl.tasks import Prompt

log = logging.getLogger("specroll.trainer")


class Feeder:
    """Submits the run's training groups and takes finished batches (module docstring).

    Args:
        config: the run (``[trainer]``: B, n, η, ``max_groups_in_flight``; ``generator.sampling``).
        client: the trainer's client.
        prompts: the prompt order.
        watch: raises while waiting once no generator is left.
    """

    def __init__(self, config: RunConfig, client: RolloutClient, prompts: PromptCycle, watch: GeneratorWatch) -> None:
        self.config, self.client, self.prompts, self.watch = config, client, prompts, watch
        tc = config.trainer
        self.admission = Admission(tc.batch_groups, tc.max_staleness, tc.max_groups_in_flight)
        self.untrained: dict[str, int] = {}
        """Training groups submitted and not yet trained: group id → its position in the prompt order
        (saved in checkpoints, so a restarted trainer submits them again)."""
        self.drops = GroupDrops(config, prompts, self.admission, self.untrained)
        """The groups the hub dropped: logged, counted, their prompts skipped or served again."""
        self._room = Wakeup()
        """Notified when a step takes finished groups or finishes, or a group is dropped: the feeder submits more."""

    async def run(self) -> None:
        """The feeder task: submit groups while :class:`Admission` has room: at most
        ``trainer.max_groups_in_flight`` queued, generating or finished-untrained, at most (η + 1)·B
        not through a finished step."""
        tc = self.config.trainer
        if (warning := run_ahead_warning(tc.max_groups_in_flight, tc.batch_groups, tc.max_staleness)) is not None:
            log.warning("%s", warning)
        while True:
            while self.admission.room(self.client.num_pending + self.client.num_finished) > 0:
                await self._submit_next()
                self.admission.on_submit()
            await self._room.wait()  # no await between the check above and this wait: no wake-up is missed

    async def submit_batch(self) -> None:
        """Sync mode: submit one step's groups."""
        for _ in range(self.config.trainer.batch_groups):
            await self._submit_next()
            self.admission.on_submit()

    async def wait_for_batch(self) -> list[Group]:
        """The ``batch_groups`` oldest finished groups, once there are that many.

        Raises:
            TrainerError: no generator connected for too long (:class:`GeneratorWatch`), or too many
                groups dropped in a row (:class:`GroupDrops`).
        """
        batch = self.config.trainer.batch_groups
        while True:
            for dropped in self.client.pop_dropped():  # first: each one gives its place in the window back
                await self._on_dropped(dropped)
            if self.client.num_finished >= batch:
                break
            self.watch.check()
            with anyio.move_on_after(self.watch.check_s):  # woken by the client when groups finish or drop
                try:
                    await self.client.wait_finished(batch)
                except GroupDropped as e:
                    await self._on_dropped(e.dropped)
        groups = self.client.pop_finished(batch)
        self.drops.finished()
        self._room.notify()  # the feeder refills what this step takes
        return groups

    async def _on_dropped(self, dropped: DroppedGroup) -> None:
        """A group the hub dropped: out of the window and the untrained positions (:class:`GroupDrops`);
        in sync mode another is submitted in its place."""
        prompt = dropped.payload.prompt_id if isinstance(dropped.payload, Prompt) else "?"
        self.drops.drop(dropped.group_id, prompt, dropped.reason, dropped.detail, by_hub=True)
        if self.config.trainer.mode == "sync":
            await self._submit_next()  # the step still needs its batch
            self.admission.on_submit()
        self._room.notify()

    def batch_done(self) -> None:
        """A step took its batch and finished (trained and published, or skipped): room for B more."""
        self.admission.on_batch_done()
        self._room.notify()

    async def _submit_next(self) -> None:
        """Submit a group of the next prompt (its sampling seed from the prompt order)."""
        draw = self.prompts.next()
        sampling = msgspec.structs.replace(self.config.generator.sampling, seed=draw.seed)
        group_id = await self.client.submit(draw.token_ids, self.config.trainer.group_size, sampling,
                                            payload=draw.prompt)
        self.untrained[group_id] = draw.position
