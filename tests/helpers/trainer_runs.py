"""The trainer as the tests run it: a small fast run's config, generator processes for it, and a
trainer in this process whose client no generator connects to."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio

from helpers.processes import actor_process
from specroll.actors.config import RunConfig, load_config
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.trainer.metrics import METRICS_FILENAME
from specroll.actors.trainer.setup import load_setup
from specroll.actors.trainer.trainer import Trainer

KV_GB = 0.02
"""KV cache of each generator :func:`generators` starts, in GB."""


def overrides(run_dir: Path, model: Path, **extra: object) -> list[str]:
    """``--set`` strings of a small fast run (η = 1; generation runs ahead of training).

    ``network.heartbeat_timeout_s`` is a hang guard here, never a deadline a test meets: it is how
    long a silent generator lives on and how long the trainer waits for acknowledgements of a version
    before it goes on without them, so a process starved for a few seconds changes nothing."""
    values: dict[str, object] = {
        "run_dir": str(run_dir), "steps": 3, "model.name": str(model), "task.builtin_count": 16,
        "trainer.batch_groups": 2, "trainer.group_size": 2, "trainer.max_groups_in_flight": 8,
        "trainer.learning_rate": 1e-3, "trainer.weight_decay": 0.1, "trainer.max_staleness": 1,
        "trainer.checkpoint_every": 1, "trainer.train_threads": 1, "generator.count": 2, "generator.heartbeat_s": 0.2,
        "generator.sampling.max_tokens": 16, "network.heartbeat_timeout_s": 60.0, "eval.every": 0,
    }
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def run_config(run_dir: Path, model: Path, **extra: object) -> RunConfig:
    return load_config(None, overrides(run_dir, model, **extra))


@contextlib.contextmanager
def generators(endpoint: str, model: Path, logs: Path, count: int = 2) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` generator processes ``gen-0``, ``gen-1``, ... (seeds 0, 1, ...) appending to ``logs/gen-I.log``."""
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(actor_process(
                [sys.executable, "-m", "specroll.actors.generator", "--connect", endpoint, "--model", str(model),
                 "--actor-id", f"gen-{i}", "--seed", str(i), "--dtype", "float32", "--kv-cache-gb", str(KV_GB),
                 "--threads", "1", "--heartbeat-s", "0.2", "--stats-s", "0.5", "--trainer-timeout-s", "60"],
                logs / f"gen-{i}.log", append=True))
            for i in range(count)
        ]
        yield procs


async def wait_for(predicate, timeout: float, what: str, procs: list[subprocess.Popen[bytes]] = ()) -> None:  # type: ignore[assignment]
    """Poll ``predicate`` until true; fail after ``timeout`` s or when a process in ``procs`` exited."""
    with anyio.fail_after(timeout):
        while not predicate():
            for p in procs:
                assert p.poll() is None, f"{p.args[2]} exited with {p.returncode} while waiting for {what}"
            await anyio.sleep(0.02)


def metrics(run_dir: Path, skipped: bool = False) -> list[dict]:
    """The metrics lines of ``run_dir``; the lines of skipped batches (nothing to train) only with ``skipped``."""
    path = run_dir / METRICS_FILENAME
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [m for m in lines if skipped or not m.get("skipped")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def trainer_without_generators(model: Path, tmp_path: Path, **extra: object) -> AsyncIterator[Trainer]:
    """A trainer (B = 2, η = 1) whose client no generator connects to: the test stands in for them."""
    config = run_config(tmp_path / "run", model, steps=10, trainer__checkpoint_every=0, **extra)
    (tmp_path / "run").mkdir()
    async with RolloutClient() as client:
        yield Trainer(config, load_setup(config), client)
