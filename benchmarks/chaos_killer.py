"""How the chaos benchmark kills: SIGKILL a role of a launched run (read from its ``pids.json``), each
generator kill at its kind of moment (a line in the generator's log), paced by the trainer's steps
(``metrics.jsonl``), and a record of every kill; network faults of the schedule are handed to
``chaos_network.py``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from chaos_network import NetworkChaos
from chaos_plan import KILL_KINDS, Plan

MARKERS = {"mid-weights-fetch": "fetching policy version", "mid-drafter-swap": "fetching drafter version",
           "after-rejoin": "welcomed by"}
"""The generator log line each kind of kill waits for (it kills right after the line appears)."""


@dataclass
class Kill:
    t: float
    """Seconds after the launch."""
    role: str
    pid: int
    kind: str
    log_offset: int = 0
    """The size of the role's log at the kill: what its restart writes comes after."""
    wall: float = 0.0
    """``time.time()`` at the kill."""
    back_s: float | None = None
    """Seconds from the kill to the restarted generator's ``welcomed by`` line (None: not back)."""


class Chaos:
    """Kills processes of a launched run (module docstring), each at its kind of moment."""

    def __init__(self, run_dir: Path, launcher: subprocess.Popen[bytes], rng: random.Random, plan: Plan,
                 network: NetworkChaos | None = None) -> None:
        self.run_dir, self.launcher, self.rng, self.plan = run_dir, launcher, rng, plan
        self.network = network
        """Makes the schedule's network faults (None: a schedule without any)."""
        self.start = time.monotonic()
        self.kills: list[Kill] = []
        self.kill_offsets: dict[str, int] = {}
        """Each role's log size when it was last killed: what its restart writes comes after."""

    def running(self) -> bool:
        return self.launcher.poll() is None

    def pids(self) -> dict[str, int]:
        try:
            return json.loads((self.run_dir / "pids.json").read_text())["processes"]
        except (OSError, ValueError, KeyError):
            return {}

    def log_size(self, role: str) -> int:
        try:
            return (self.run_dir / "logs" / f"{role}.log").stat().st_size
        except OSError:
            return 0

    def new_text(self, role: str, offset: int) -> str:
        try:
            with (self.run_dir / "logs" / f"{role}.log").open("rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def live_pid(self, role: str) -> int | None:
        """``role``'s current process, or None while it is down (killed here, not yet restarted)."""
        pid = self.pids().get(role)
        return None if pid is None or pid in {k.pid for k in self.kills} else pid

    def kill(self, role: str, kind: str) -> bool:
        """SIGKILL ``role``'s process, waiting (while the run lasts) for it to be up if it is down."""
        while (pid := self.live_pid(role)) is None:
            if not self.running():
                return False
            time.sleep(0.02)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        offset = self.log_size(role)
        self.kills.append(Kill(round(time.monotonic() - self.start, 2), role, pid, kind, offset, time.time()))
        self.kill_offsets[role] = offset
        print(f"chaos: {time.monotonic() - self.start:7.1f} s  SIGKILL {role} (pid {pid}) {kind}", flush=True)
        return True

    def wait_marker(self, roles: list[str], marker: str, give_up_at_step: int,
                    after: dict[str, int] | None = None) -> str | None:
        """The first of ``roles`` whose log shows ``marker`` after now (or after the offsets ``after``),
        within ``event_wait_s`` and before the trainer logs step ``give_up_at_step``."""
        offsets = {r: self.log_size(r) for r in roles} | (after or {})
        deadline = time.monotonic() + self.plan.event_wait_s
        while time.monotonic() < deadline and self.running() and self.step() < give_up_at_step:
            for role in roles:
                if marker in self.new_text(role, offsets[role]):
                    return role
            time.sleep(0.005)
        return None

    def kill_generator(self, kind: str, give_up_at_step: int) -> None:
        generators = [f"generator-{i}" for i in range(self.plan.generators)]
        if kind == "after-rejoin":  # the one killed last, once its restart is welcomed again
            last = next((k.role for k in reversed(self.kills) if k.role.startswith("generator")), None)
            roles = [last] if last is not None else generators
        else:
            roles = self.rng.sample(generators, len(generators))
        if kind in MARKERS:
            rejoin = kind == "after-rejoin"
            after = {r: self.kill_offsets[r] for r in roles if r in self.kill_offsets} if rejoin else None
            role = self.wait_marker(roles, MARKERS[kind], give_up_at_step, after)
            if role is not None:
                self.kill(role, kind)
                return
            kind = f"mid-chunk ({kind} not seen in time)"
        up = [r for r in roles if self.live_pid(r) is not None]
        self.kill(self.rng.choice(up or roles), kind)

    def step(self) -> int:
        """The highest step the trainer has logged so far (0 before the first)."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        steps = [0]
        for line in lines:
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line being written
        return max(steps)

    def wait_step(self, step: int) -> None:
        while self.running() and self.step() < step:
            time.sleep(0.02)

    def run(self) -> None:
        """Kill on the plan's schedule until it is done or the run ends.

        Kills are paced by training progress, not by the clock, so every kill lands inside the run
        however fast the machine is: kill i waits for step ``schedule[i].step``, and a kill that waits
        for its moment (a log line) gives up at the next kill's step, when it kills at a random moment
        instead. The last kill is due at about 70% of the steps."""
        for slot in self.plan.schedule():
            self.wait_step(slot.step)
            if not self.running():
                break
            if slot.kind == "drafter":
                self.kill("drafter", "drafter trainer")
            elif slot.kind == "trainer":
                self.kill("trainer", "trainer")
            elif slot.kind in KILL_KINDS:
                self.kill_generator(slot.kind, give_up_at_step=slot.give_up_step)
            else:
                assert self.network is not None, f"{slot.kind}: a network fault, and no relay"
                self.network.apply(slot.kind, [f"generator-{i}" for i in range(self.plan.generators)],
                                   lambda: self.live_pid("trainer"))
