"""A benchmark script run to its end as a test runs it: in its own session, its whole tree killed on a hang."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_benchmark(cmd: list[str], timeout_s: float) -> tuple[str, int]:
    """Run a benchmark script to its end; return its output and its pid (the id of its process
    group, which must be empty afterwards); fail the test on a non-zero exit or
    after ``timeout_s`` (a hang guard). It runs in its own session, so on a timeout the whole tree goes
    (the launchers' roles die with their launcher)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[1:3])} did not finish within {timeout_s} s:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    return log, proc.pid
