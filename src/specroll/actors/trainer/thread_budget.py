"""The trainer's CPU threads for one step: ``trainer.train_threads`` (torch's default when unset),
plus ``trainer.borrow_threads`` for a micro-batch while the generators are idle — no rollout is
queued or generating, so their cores are free then. Decided before each micro-batch (with several
ranks: once per step, by rank 0, ``policy.py``); back to the base count when the step ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def thread_budget(train_threads: int | None, borrow_threads: int | None,
                  generators_idle: Callable[[], bool]) -> Iterator[Callable[[], None]]:
    """Yields the ``before_micro_batch`` callback of ``Policy.train``: it sets torch's intra-op
    threads to the base count, plus ``borrow_threads`` when ``generators_idle()``. The base count is
    restored on exit."""
    base = train_threads or torch.get_num_threads()
    borrow = borrow_threads or 0

    def budget() -> None:  # the generators' idle cores, for the next micro-batch
        torch.set_num_threads(base + borrow if borrow and generators_idle() else base)

    try:
        yield budget
    finally:
        torch.set_num_threads(base)
