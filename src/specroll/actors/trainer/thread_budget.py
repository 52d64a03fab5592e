"""The trainer's CPU threads for one step: ``trainer.train_threads`` (torch's default when unset),
plus ``trainer.borrow_threads`` for a phase of the step while the generators are idle — no rollout
is queued or generating, so their cores are free then. Decided before each phase (each
micro-batch's forward, its backward, the optimizer step: ``grpo_step.train_step``; with several
ranks once per step, by rank 0, ``policy.py``), so a generator that goes idle mid-step lends its
core from the next phase on and one that gets work back has it again at the next phase; back to
the base count when the step ends. The share of phases that borrowed is in the step's metrics
(``threads_borrowed``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


class ThreadBudget:
    """The ``before_phase`` callback of ``Policy.train``: sets torch's intra-op threads to ``base``,
    plus ``borrow`` when ``generators_idle()``, and counts the phases that borrowed."""

    def __init__(self, base: int, borrow: int, generators_idle: Callable[[], bool]) -> None:
        self.base, self.borrow, self.generators_idle = base, borrow, generators_idle
        self.phases = self.borrowed = 0

    def __call__(self) -> None:
        take = self.borrow > 0 and self.generators_idle()
        torch.set_num_threads(self.base + self.borrow if take else self.base)
        self.phases += 1
        self.borrowed += take

    @property
    def borrowed_fraction(self) -> float | None:
        """Phases that ran with the borrowed threads, over all phases (None before any, or never borrowing)."""
        return self.borrowed / self.phases if self.phases and self.borrow else None


@contextlib.contextmanager
def thread_budget(train_threads: int | None, borrow_threads: int | None,
                  generators_idle: Callable[[], bool]) -> Iterator[ThreadBudget]:
    """A :class:`ThreadBudget` for one step; the base count is restored on exit."""
    base = train_threads or torch.get_num_threads()
    try:
        yield ThreadBudget(base, borrow_threads or 0, generators_idle)
    finally:
        torch.set_num_threads(base)
