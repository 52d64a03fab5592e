"""The libzmq abort that killed the trainer on network faults (``benchmarks/zmq_abort.py``): a peer's
new connection takes its route over on the hub's ROUTER while the old connection still delivers,
then the old one is closed. libzmq 4.3.5 aborts the process there when the ROUTER sends ZMTP PINGs
of its own; the hub's socket, made as the trainer makes it, sends none and lives on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.timeouts import guard

pytestmark = pytest.mark.integration  # starts the hub in a process of its own

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "zmq_abort.py"


def test_the_hub_survives_a_route_taken_over_while_the_old_connection_delivers() -> None:
    # The abort comes within two heartbeat intervals (1 s each) of the old connection's close; the
    # hub is watched 5 s, and must still answer a new connection afterwards.
    log, _ = run_benchmark([sys.executable, str(SCRIPT), "--watch-s", "5"], guard(120))
    assert "the hub survived the fault and still answers" in log, log
