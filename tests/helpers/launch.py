"""``specroll launch`` as the tests start it: a small run's config, the launcher as a child process,
and the checks that no process it started outlives it (read from ``/proc``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.timeouts import guard


def write_config(tmp_path: Path, model: Path, steps: int = 3, count: int = 2, eval_every: int = 0) -> Path:
    """A small run on ``model``: ``count`` generators, one group of 2 per step, 8 tokens per sample;
    ``eval_every`` > 0: a held-out evaluation on 4 prompts before training, every so many steps and at the end."""
    path = tmp_path / "run.toml"
    path.write_text(f"""
run_dir = "{tmp_path / 'run'}"
steps = {steps}

[model]
name = "{model}"

[trainer]
batch_groups = 1
group_size = 2
max_groups_in_flight = 2
train_threads = 1

[generator]
count = {count}
heartbeat_s = 0.5

[network]
heartbeat_timeout_s = 60.0  # a hang guard: a starved generator is not declared dead

[generator.engine]
dtype = "float32"
kv_cache_memory_gb = 0.02
max_num_seqs = 8
num_threads = 1

[generator.sampling]
max_tokens = 8

[eval]
every = {eval_every}
count = 4
""")
    return path


def with_drafter(config: Path, duty_cycle: float = 1.0) -> Path:
    """``config`` (from :func:`write_config`) with the drafter trainer on, sized for a tiny model, and
    the generators drafting with it."""
    config.write_text(config.read_text().replace("[generator]\n", '[generator]\nspeculative = "auto"\n') + f"""
[drafter]
enabled = true
min_rollouts = 2
publish_every_steps = 2
window_tokens = 16
draft_vocab_size = 64
duty_cycle = {duty_cycle}
""")
    return config


def children_of(pid: int) -> set[int]:
    """Live (non-zombie) processes whose parent is ``pid``."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def members_of_groups(pgids: set[int]) -> set[int]:
    """Live processes in any of the process groups ``pgids``."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) in pgids and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def started_pids(run_dir: Path) -> dict[str, int]:
    """Role name → the pid of its latest process, as the launcher recorded them in RUN_DIR/pids.json
    (``processes``: not yet reaped; ``exited``: reaped)."""
    pids = json.loads((run_dir / "pids.json").read_text())
    latest = {e["role"]: e["pid"] for e in pids["exited"]}
    return {**latest, **{name: pid for name, pid in pids["processes"].items() if "@" not in name}}


def every_started_pid(run_dir: Path) -> set[int]:
    """Every pid the launcher recorded in RUN_DIR/pids.json, reaped ones included."""
    pids = json.loads((run_dir / "pids.json").read_text())
    return set(pids["processes"].values()) | {e["pid"] for e in pids["exited"]}


def live(pids: set[int]) -> set[int]:
    """The processes among ``pids`` that exist and are not zombies."""
    found = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                found.add(pid)
        except OSError:
            continue
    return found


def assert_nothing_left(run_dir: Path, children_before: set[int]) -> None:
    """No process the launcher started, nor anything in their process groups, nor a new child of ours.

    A SIGKILLed group member the launcher does not reap (a grandchild) leaves ``/proc`` only once it is
    reaped, a moment later on a loaded machine: polled for, not slept for."""
    pids = every_started_pid(run_dir)
    deadline = time.monotonic() + guard(30)  # a hang guard; normally the first look finds nothing
    while (live(pids) or members_of_groups(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(pids), f"started processes still alive: {live(pids)}"
    assert not members_of_groups(pids), "processes left in the launched process groups"
    assert children_of(os.getpid()) <= children_before, "a child of the test process remains"


def launch(tmp_path: Path, config: Path, *extra: str, path: Path | None = None) -> subprocess.Popen[str]:
    """``specroll launch CONFIG`` as a child process (``path``: a folder put first on its ``PYTHONPATH``,
    for a stand-in module of ``--trainer-module``)."""
    # a long grace: a process starved for a while is still stopped by SIGTERM (tests check it is)
    cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(config), "--grace-s", "60", *extra]
    env = None
    if path is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen[str], timeout: float | None = None) -> tuple[int, str, str]:
    """Wait for the launcher to exit (a hang guard of ``timeout`` s, default ``guard(180)``); return its
    exit code, stdout and stderr."""
    timeout = guard(180) if timeout is None else timeout
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # the launcher's children get SIGKILL too (PR_SET_PDEATHSIG)
        out, err = proc.communicate()
        pytest.fail(f"launcher did not finish within {timeout} s; stderr:\n{err}")
    return proc.returncode, out, err


def wait_for(predicate: Callable[[], bool], what: str, proc: subprocess.Popen[str],
             timeout: float | None = None) -> None:
    """Poll ``predicate``; fail when the launcher exits first or after ``timeout`` s (default ``guard(120)``)."""
    timeout = guard(120) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"launcher exited ({proc.returncode}) while waiting for {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def welcomed(run_dir: Path, role: str, offset: int = 0) -> bool:
    """Peer ``role``'s log shows a welcome by the trainer past its first ``offset`` bytes (a restarted
    process joined: pass the log's size before the restart). Its actor is made by then."""
    log = run_dir / "logs" / f"{role}.log"
    return log.exists() and "welcomed by" in log.read_bytes()[offset:].decode(errors="replace")


def model_loaded(run_dir: Path, role: str) -> bool:
    """Generator ``role``'s log says its model is loaded (it handles a stop itself from before that)."""
    log = run_dir / "logs" / f"{role}.log"
    return log.exists() and "; connecting to " in log.read_text(errors="replace")


def generators_connected(run_dir: Path, count: int) -> bool:
    return all(welcomed(run_dir, f"generator-{i}") for i in range(count))


def launched_episode_run(tmp_path: Path, model: Path, task_toml: str) -> tuple[list[dict], list[dict]]:
    """Launch a 2-step episode run on ``model`` (one generator, evaluations at steps 0 and 2, the
    server on a free port) with ``task_toml`` as its ``[task]`` table's body; check it exits 0 and
    leaves nothing running; return (every metrics record, the trained steps' records)."""
    config = write_config(tmp_path, model, steps=2, count=1, eval_every=2)
    config.write_text(config.read_text() + f"\n[task]\n{task_toml}\n\n[server]\nport = 0\n")
    before = children_of(os.getpid())
    code, _, err = finish(launch(tmp_path, config), timeout=guard(300))
    run_dir = tmp_path / "run"
    assert code == 0, err
    assert_nothing_left(run_dir, before)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and not r.get("skipped")]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    return records, steps
