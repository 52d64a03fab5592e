"""Where an engine step's time goes: schedule, propose, metadata, forward, sample/verify, emit.

Off by default and then free (one attribute test per phase boundary). Turned on
(``Engine.phases.enabled = True``) it reads ``time.perf_counter`` at each boundary and adds the
interval to that phase's total; on a CUDA device it first waits for the device
(``torch.cuda.synchronize``), so a phase is charged for its kernels and not only for launching
them — which adds host–device syncs to the step, so use it to profile, never in production.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch

Phase = Literal["schedule", "propose", "metadata", "forward", "sample", "emit"]
PHASES: tuple[Phase, ...] = ("schedule", "propose", "metadata", "forward", "sample", "emit")
"""The phases of ``Engine.step`` in order: ``schedule`` picks the batch, ``propose`` drafts,
``metadata`` builds the batch's inputs and plans attention, ``forward`` runs the target and its LM
head, ``sample`` samples or verifies, ``emit`` appends the tokens, retires finished requests and
hands features to a proposer."""


@dataclass
class PhaseTimes:
    """Seconds per phase summed over ``steps`` engine steps."""

    seconds: dict[Phase, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0

    def per_step_ms(self) -> dict[Phase, float]:
        """Mean milliseconds per step of each phase (0.0 before any step)."""
        return {p: 1e3 * s / self.steps if self.steps else 0.0 for p, s in self.seconds.items()}


class PhaseClock:
    """Times the phases of engine steps into :attr:`totals` while :attr:`enabled`.

    Args:
        device: the engine's device; CUDA work is waited for at each boundary.
    """

    def __init__(self, device: torch.device) -> None:
        self.enabled = False
        self.totals = PhaseTimes()
        self._sync = device.type == "cuda"
        self._last = 0.0

    def reset(self) -> None:
        """Zero the totals."""
        self.totals = PhaseTimes()

    def start(self) -> None:
        """A step begins."""
        if self.enabled:
            self._last = self._now()

    def mark(self, phase: Phase) -> None:
        """``phase`` ended now: charge it the time since the last boundary."""
        if self.enabled:
            now = self._now()
            self.totals.seconds[phase] += now - self._last
            self._last = now

    def end_step(self) -> None:
        """Count one timed step (after its last :meth:`mark`)."""
        if self.enabled:
            self.totals.steps += 1

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()
