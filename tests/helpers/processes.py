"""Actor processes for the tests: each in its own process group, output to a log, the whole group
killed and reaped on the way out, also on failure."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from helpers.timeouts import guard


@contextlib.contextmanager
def actor_process(cmd: list[str], log: Path, append: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` in its own process group, output to ``log`` (after what it holds, with ``append``); the
    whole group is killed and reaped on the way out."""
    with open(log, "ab" if append else "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=guard(30))


def generator_process(
    endpoint: str, model: Path, log: Path, *extra: str, actor_id: str = "gen-0", kv_gb: float = 0.02
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``python -m specroll.actors.generator`` as an :func:`actor_process` (float32, 1 thread, fast heartbeats)."""
    cmd = [sys.executable, "-m", "specroll.actors.generator", "--connect", endpoint, "--model", str(model),
           "--actor-id", actor_id, "--dtype", "float32", "--kv-cache-gb", str(kv_gb), "--threads", "1",
           "--heartbeat-s", "0.2", "--stats-s", "0.5", "--trainer-timeout-s", "30", *extra]
    return actor_process(cmd, log)


def drafter_process(
    endpoint: str, config: Path, log: Path, actor_id: str = "drafter-0"
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``python -m specroll.actors.drafter_trainer`` with run config ``config``, as an :func:`actor_process`."""
    return actor_process([sys.executable, "-m", "specroll.actors.drafter_trainer", "--connect", endpoint, "--config",
                          str(config), "--actor-id", actor_id], log)


async def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; a hang guard of ``timeout`` seconds names ``what`` was awaited."""
    import anyio

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await anyio.sleep(0.05)
