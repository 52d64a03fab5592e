"""The chaos benchmark's network faults (``bench_chaos.py --network``): every peer of the launched run
connects to the trainer through a relay (``fault_proxy.py``, ``network.peer_endpoint``), which
stalls, resets or leaves half-open one generator's connections, or slows every link; and the trainer
is paused once (SIGSTOP for longer than its peers' ZMTP timeout, then SIGCONT) while the relay holds
what its old connections carry. Each is recorded."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from chaos_plan import Plan
from fault_proxy import FaultProxy


@dataclass
class Fault:
    t: float
    """Seconds after the launch."""
    kind: str
    target: str
    """The generator whose connections it hit, ``every link``, or ``trainer`` (a pause)."""
    connections: int
    """Connections it stalled or cut (0 for ``slow``)."""
    wall: float = 0.0
    """``time.time()`` when it began."""


class NetworkChaos:
    """Makes the plan's network faults through ``proxy`` (module docstring).

    Args:
        proxy: the relay every peer of the run connects through.
        plan: the durations and rates of the faults.
        rng: picks the generator a fault hits.
        start: ``time.monotonic()`` at the launch.
        running: whether the launched run still runs.
    """

    def __init__(self, proxy: FaultProxy, plan: Plan, rng: random.Random, start: float,
                 running: Callable[[], bool]) -> None:
        self.proxy, self.plan, self.rng, self.start, self.running = proxy, plan, rng, start, running
        self.faults: list[Fault] = []
        self._slow_end: threading.Timer | None = None

    def apply(self, kind: str, generators: list[str], trainer_pid: Callable[[], int | None]) -> None:
        """Make one fault of ``kind`` (``NETWORK_KINDS`` or ``trainer-pause``) on one of
        ``generators`` connected through the relay; a link fault waits (while the run lasts) for one to be."""
        if kind == "trainer-pause":
            self._pause(trainer_pid)
        elif kind == "slow":
            self.proxy.delay(self.plan.slow_delay_ms)
            self.proxy.throttle(self.plan.slow_bytes_per_s)
            self._slow_end = threading.Timer(self.plan.slow_s, self._unslow)
            self._slow_end.daemon = True
            self._slow_end.start()
            self._record(kind, "every link", 0)
        else:
            target = self._connected(generators)
            if target is None:
                print(f"chaos: {kind}: the run ended before a generator connected through the relay", flush=True)
                return
            ident = target.encode()
            if kind == "stall":
                n = self.proxy.stall(self.plan.stall_s, identity=ident)
            else:
                n = self.proxy.cut("reset" if kind == "reset" else "half-open", identity=ident)
            self._record(kind, target, n)

    def close(self) -> None:
        """End a slowdown still in force (a pause always ends before :meth:`apply` returns)."""
        if self._slow_end is not None:
            self._slow_end.cancel()
        self._unslow()

    def _connected(self, generators: list[str]) -> str | None:
        """One of ``generators`` with a connection through the relay, once there is one; None when
        the run ended first."""
        while self.running():
            up = sorted(set(generators) & {i.decode(errors="replace") for i in self.proxy.identities()})
            if up:
                return self.rng.choice(up)
            time.sleep(0.05)
        return None

    def _pause(self, trainer_pid: Callable[[], int | None]) -> None:
        pid = trainer_pid()
        if pid is None:
            print("chaos: trainer-pause: no trainer running; skipped", flush=True)
            return
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        # The links open now hold what the peers send while the trainer is stopped; the peers' ZMTP
        # timeout passes and they connect again on new links, which flow. Once the trainer runs and
        # took the routes over onto the new links, the old ones deliver what they held and close:
        # the takeover with a late delivery that made libzmq abort the trainer (zmq_abort.py).
        held = self.proxy.stall(None, new_connections=False)
        self._record("trainer-pause", "trainer", held)
        try:
            time.sleep(self.plan.pause_s)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            time.sleep(self.plan.takeover_s)
            self.proxy.resume()

    def _unslow(self) -> None:
        self.proxy.delay(0)
        self.proxy.throttle(None)

    def _record(self, kind: str, target: str, connections: int) -> None:
        t = round(time.monotonic() - self.start, 2)
        self.faults.append(Fault(t, kind, target, connections, time.time()))
        print(f"chaos: {t:7.1f} s  {kind} {target} ({connections} connections)", flush=True)
