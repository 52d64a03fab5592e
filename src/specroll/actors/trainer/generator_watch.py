"""The trainer's watch for generators: while it waits for rollouts, it gives up (exit 3) once no
generator has been connected for ``NO_GENERATOR_FACTOR × network.heartbeat_timeout_s``."""

from __future__ import annotations

import time

import anyio

from specroll.actors.rollout.client import RolloutClient
from specroll.actors.shared.exit_codes import EXIT_PEER_LOST
from specroll.actors.trainer.setup import TrainerError

NO_GENERATOR_FACTOR = 3
"""The trainer gives up after ``NO_GENERATOR_FACTOR × network.heartbeat_timeout_s`` without generators."""


class GeneratorWatch:
    """Whether some generator is connected to ``client``, checked while the trainer waits.

    Args:
        client: the trainer's client.
        heartbeat_timeout_s: ``network.heartbeat_timeout_s``.
    """

    def __init__(self, client: RolloutClient, heartbeat_timeout_s: float) -> None:
        self.client = client
        self.no_generator_s = NO_GENERATOR_FACTOR * heartbeat_timeout_s
        self.check_s = min(1.0, self.no_generator_s / 4)
        """Seconds between checks that some generator is connected, while waiting for one."""
        self._alone_since: float | None = None

    def check(self) -> None:
        """Raise once no generator has been connected for ``no_generator_s``.

        Raises:
            TrainerError: with exit code 3 (``EXIT_PEER_LOST``).
        """
        if self.client.coordinator.generators:
            self._alone_since = None
            return
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        elif now - self._alone_since > self.no_generator_s:
            raise TrainerError(
                f"no generator connected to {self.client.endpoint} for {self.no_generator_s:.0f} s "
                f"({NO_GENERATOR_FACTOR} x network.heartbeat_timeout_s); are generators running and pointed here?",
                EXIT_PEER_LOST)

    async def wait_for_one(self) -> None:
        """Until some generator is connected (checking, so this raises like :meth:`check`)."""
        while not self.client.coordinator.generators:
            self.check()
            with anyio.move_on_after(self.check_s):
                await self.client.wait_for_generators(1)
