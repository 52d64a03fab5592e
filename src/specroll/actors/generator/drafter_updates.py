"""Which drafter version a generator fetches, and what it does with one that arrives.

With ``speculative = "eagle"`` a generator fetches the newest drafter version announced
(``DrafterAvailable`` → ``FetchDrafter`` → ``DrafterWeights``), one at a time; what arrives is
bounded by the protocol's limits, then checked in a worker thread (checksum, fit to the target:
:func:`~specroll.actors.generator.drafter_swap.check_drafter`) and queued for the step loop, which
swaps it in between engine steps (``drafter_swap.py``). A refused version is acknowledged with the
reason and the generator waits for a newer announcement, still serving what it served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch

from specroll.actors.generator.drafter_swap import DrafterSlot, ReadyDrafter, check_drafter
from specroll.drafter.eagle_config import DrafterError
from specroll.engine.engine import Engine
from specroll.protocol.limits import (
    MAX_DRAFTER_CONFIG_CHARS,
    MAX_DRAFTER_TENSORS,
    MAX_ID_CHARS,
    LimitExceeded,
    check_at_most,
)
from specroll.protocol.messages import AckDrafter, DrafterWeights, FetchDrafter

log = logging.getLogger("specroll.generator")


@dataclass
class DrafterFetch:
    """Which drafter version a generator fetches: the newest announced one above the served one,
    one fetch at a time. The trainer keeps only the newest version, so a fetch that a newer
    announcement overtakes before its answer arrived is dropped and the newer one fetched."""

    fetching: int = 0
    """The version asked for and not yet served (0: none)."""
    announced: int = 0
    """The newest version announced."""

    def on_announced(self, version: int, *, received: bool) -> None:
        """``version`` was announced; ``received``: the version being fetched already arrived."""
        self.announced = max(self.announced, version)
        if self.fetching and version > self.fetching and not received:
            self.fetching = 0  # superseded before it arrived

    def next(self, served: int) -> int | None:
        """The version to fetch now (and mark it fetching), or ``None``."""
        if self.fetching or self.announced <= served:
            return None
        self.fetching = self.announced
        return self.fetching

    def superseded(self, version: int) -> bool:
        """``version`` arrived unasked because a newer one was announced meanwhile."""
        return version != self.fetching and version < self.announced

    def refused(self, served: int) -> None:
        """The fetched version was refused: fetch again only after a newer announcement."""
        self.fetching, self.announced = 0, served

    def done(self, version: int) -> None:
        """``version`` was swapped in (or refused by the engine)."""
        if self.fetching == version:
            self.fetching = 0


class DrafterUpdates:
    """The drafter versions a generator is told of and fetches (module docstring).

    Args:
        engine: the generator's engine (what a received head is checked against).
        slot: the drafter the engine serves (its version).
        put: queues a message to the trainer.
        ready: queues a checked version for the step loop (and wakes it).
        enabled: ``speculative == "eagle"``: only then are versions fetched.
    """

    def __init__(self, engine: Engine, slot: DrafterSlot, put: Callable[[object], None],
                 ready: Callable[[ReadyDrafter], None], *, enabled: bool) -> None:
        self.engine = engine
        self.slot = slot
        self._put = put
        self._ready = ready
        self.enabled = enabled
        self.fetch = DrafterFetch()

    def on_announced(self, version: int, *, received: bool) -> None:
        """``version`` was announced; ``received``: the version being fetched already arrived (and
        waits in the step loop's queue)."""
        self.fetch.on_announced(version, received=received)
        self._maybe_fetch()

    async def on_weights(self, msg: DrafterWeights, tensors: dict[str, torch.Tensor]) -> str | None:
        """Bound and check a received version, then queue it for the step loop. Returns why the message
        is refused (to be answered with an ``Error``), or ``None``; a head that fails its checks is
        answered here with a refusing ``AckDrafter``."""
        if msg.version != self.fetch.fetching:
            if self.fetch.superseded(msg.version):
                log.debug("drafter version %d arrived after a newer one was announced; dropped", msg.version)
                return None
            return f"drafter version {msg.version} was not fetched (fetching {self.fetch.fetching or None})"
        try:
            check_at_most("DrafterWeights.len(tensors)", len(msg.tensors), MAX_DRAFTER_TENSORS, "protocol limit")
            check_at_most("DrafterWeights.len(config)", len(msg.config), MAX_DRAFTER_CONFIG_CHARS, "protocol limit")
            check_at_most("DrafterWeights.len(checksum)", len(msg.checksum), MAX_ID_CHARS, "protocol limit")
        except LimitExceeded as e:
            self.fetch.refused(self.slot.version)  # wait for a newer announcement
            return str(e)
        try:
            ready = await anyio.to_thread.run_sync(check_drafter, msg, tensors, self.engine)
        except DrafterError as e:
            log.error("%s; still serving drafter version %d", e, self.slot.version)
            self._put(AckDrafter(version=msg.version, checksum="", refused=str(e)[:500]))
            self.fetch.refused(self.slot.version)  # wait for a newer announcement
            return None
        self._ready(ready)
        return None

    def swapped(self, version: int) -> None:
        """The step loop swapped ``version`` in (or the engine refused it); fetch the next one if any."""
        self.fetch.done(version)
        self._maybe_fetch()

    def reset(self) -> None:
        """A restarted trainer numbers its own drafter versions: forget the old one's."""
        self.fetch = DrafterFetch()

    def _maybe_fetch(self) -> None:
        """Fetch the newest announced drafter version when speculating with a learned drafter."""
        if not self.enabled or (v := self.fetch.next(self.slot.version)) is None:
            return
        log.info("fetching drafter version %d", v)
        self._put(FetchDrafter(version=v))
