"""``specroll launch --cluster ray``: every role a Ray actor's child on a local Ray instance that the
test starts (``ray.init(num_cpus=2)``) and stops; real processes, real sockets, a tiny random model.
The Ray tests are skipped, with the reason, when ``ray`` is not installed (``pip install 'specroll[ray]'``).

Every process the test's Ray started — its raylet and workers, the role hosts, the roles — descends
from the test process: none may remain once the launch ended and Ray was shut down.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.launch import finish, live, members_of_groups, started_pids, wait_for, write_config
from helpers.timeouts import guard

from specroll.actors.config import ConfigError, load_config

pytestmark = pytest.mark.integration  # every test here starts a process

HANG_S = guard(900)
"""Hang guards only: a fresh interpreter per role plus Ray's own workers take minutes of wall time on
2 busy cores (a 120 s guard was exceeded beside two busy processes)."""


def descendants_of(pid: int) -> set[int]:
    """Live (non-zombie) processes below ``pid`` in the process tree."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def poll_until_gone(pids: set[int], what: str) -> None:
    """A hang guard (SIGKILLed processes leave ``/proc`` once reaped, a moment later): polled, not slept for."""
    deadline = time.monotonic() + 60
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(pids), f"{what} still alive: {live(pids)}"


@pytest.fixture
def local_ray() -> Iterator[str]:
    """A Ray instance with 2 CPUs started by (and descending from) this test; yields its GCS address.
    Its temp dir is short (its socket paths stay under Linux's ~107 bytes) and its own."""
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'specroll[ray]'")
    before = descendants_of(os.getpid())
    temp_dir = tempfile.mkdtemp(prefix="sr-ray-", dir="/tmp")
    try:
        context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
        try:
            yield context.address_info["gcs_address"]
        finally:
            ray.shutdown()
        poll_until_gone(descendants_of(os.getpid()) - before, "processes started by the test's Ray")
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_config(tmp_path: Path, model: Path, steps: int, count: int, ranks: int = 1) -> Path:
    """The small run of ``test_launch`` fitting 2 Ray CPUs: the trainer's ``ranks`` 1 CPU in all, the
    ``count`` generators 1 in all."""
    config = write_config(tmp_path, model, steps=steps, count=count)
    text = config.read_text().replace("batch_groups = 1", f"batch_groups = {ranks}\nworld_size = {ranks}")
    cluster = f"[cluster.generator]\nnum_cpus = {1 / count}\n\n[cluster.trainer]\nnum_cpus = {1 / ranks}\n"
    config.write_text(f"{text}\n{cluster}")
    return config


def launch_on_ray(config: Path, address: str, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(config), "--cluster", "ray", "--set",
           f"cluster.address={address}", "--grace-s", "60", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_ray_launch_runs_three_steps_and_leaves_nothing(tmp_path: Path, tiny_checkpoint, local_ray: str) -> None:
    # One generator: it is welcomed before the trainer can finish, so the launcher's SIGTERM never meets a
    # generator still in its handshake (which waits for the trainer up to network.heartbeat_timeout_s).
    # With CURVE: each role's key files travel in its start request to a private folder on its node.
    config = ray_config(tmp_path, tiny_checkpoint(), steps=3, count=1)
    code, out, err = finish(launch_on_ray(config, local_ray, "--set", "network.security=curve"), timeout=HANG_S)
    run_dir = tmp_path / "run"
    assert code == 0, err
    assert f"joined the Ray cluster at {local_ray}" in err
    for role, cpus in (("trainer", 1), ("generator-0", 1)):
        assert f"started {role} (pid {started_pids(run_dir)[role]} on node " in err
        assert f"Ray actor: {cpus:g} CPU, 0 GPU)" in err.split(f"started {role} ")[1].splitlines()[0]
    # a skipped batch (nothing to train) has a line of its own and is drawn again for its step
    steps = [line.split(":")[0] for line in out.splitlines() if "skipped" not in line.split(":")[0]]
    assert steps == ["step 1", "step 2", "step 3"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("skipped")] == [1, 2, 3]
    log = (run_dir / "logs" / "generator-0.log").read_text()
    assert "welcomed by" in log and "exits with code 0: received SIGTERM" in log, log
    assert f"CURVE security: made the run's keys in {run_dir / 'keys'}" in err
    keys: dict[str, set[Path]] = {}
    for role in ("trainer", "generator-0"):
        # a line per start of the role: on a starved machine the launcher may have restarted it
        lines = [x for x in (run_dir / "logs" / f"{role}.log").read_text().splitlines() if "CURVE security: " in x]
        keys[role] = {Path(line.rsplit(" from ", 1)[1]) for line in lines}
        assert lines and all(k.name.startswith("specroll-keys-") for k in keys[role]), lines  # not RUN_DIR/keys
        assert not any(k.exists() for k in keys[role])  # removed when the run ended
    assert not keys["trainer"] & keys["generator-0"]
    pids = set(started_pids(run_dir).values())
    poll_until_gone(pids, "the roles")  # the launcher ended: every role is stopped, before Ray is
    assert not members_of_groups(pids), "processes left in the roles' process groups"


@pytest.mark.slow
def test_ray_launch_restarts_a_dead_role_and_a_dead_actor(tmp_path: Path, tiny_checkpoint, local_ray: str) -> None:
    """Supervision through Ray, with a trainer of 2 ranks (packed on one node by a placement group):
    generator-0's process ends (SIGINT: a role hosted by a Ray worker, which blocks SIGINT, must still
    get it) and its actor starts it again; generator-1's actor is killed (as when its node is lost: its
    process dies with it, a new actor is placed); both rejoin; SIGTERM ends the run."""
    config = ray_config(tmp_path, tiny_checkpoint(), steps=1_000_000, count=2, ranks=2)
    run_dir = tmp_path / "run"
    err_path = tmp_path / "launcher.err"
    with err_path.open("w") as err_file:
        cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(config), "--cluster", "ray", "--set",
               f"cluster.address={local_ray}", "--grace-s", "60"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, text=True)
    try:
        def welcomed(role: str, times: int) -> bool:
            log = run_dir / "logs" / f"{role}.log"
            return log.exists() and log.read_text(errors="replace").count("welcomed by") >= times

        wait_for(lambda: welcomed("generator-0", 1) and welcomed("generator-1", 1), "both generators", proc,
                 timeout=HANG_S)
        first = started_pids(run_dir)
        os.kill(first["generator-0"], signal.SIGINT)
        actor_pid = int(Path(f"/proc/{first['generator-1']}/stat").read_text().rpartition(")")[2].split()[1])
        os.kill(actor_pid, signal.SIGKILL)  # generator-1's Ray worker: its actor dies, and its process with it
        wait_for(lambda: welcomed("generator-0", 2) and welcomed("generator-1", 2), "both generators back",
                 proc, timeout=HANG_S)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err_path.read_text()
    assert code == 128 + signal.SIGTERM, err
    assert "Ray resources: trainer 0.5 CPU 0 GPU (1 thread(s)) x 2 ranks (one node)" in err, err
    assert f"started trainer-rank1 (pid {first['trainer-rank1']} on node " in err, err
    assert f"generator-0 (pid {first['generator-0']}) exited with code 0; restart 1 of generator-0" in err, err
    assert f"generator-1 (pid {first['generator-1']}) was killed by SIGKILL; restart 1 of generator-1" in err, err
    assert "its Ray actor died" in (run_dir / "logs" / "generator-1.log").read_text()
    again = started_pids(run_dir)
    assert again["generator-0"] != first["generator-0"] and again["generator-1"] != first["generator-1"]
    pids = set(first.values()) | set(again.values())
    poll_until_gone(pids, "the roles")
    assert not members_of_groups(pids), "processes left in the roles' process groups"


def test_a_bad_cluster_backend_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.backend='slurm', expected one of 'local', 'ray'"):
        load_config(None, ["cluster.backend=slurm"])
    with pytest.raises(ConfigError, match=r"cluster\.generator\.num_gpus=1\.5, expected a fraction below 1"):
        load_config(None, ["cluster.generator.num_gpus=1.5"])
    assert load_config(None, []).cluster.backend == "local"
    path = tmp_path / "run.toml"
    path.write_text(f'run_dir = "{tmp_path / "run"}"\n[cluster]\nbackend = "k8s"\n')
    proc = subprocess.run([sys.executable, "-m", "specroll.actors.cli", "launch", str(path)],
                          capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 2
    assert proc.stderr == (f"specroll launch: error: {path}: cluster.backend='k8s', expected one of 'local', "
                           f"'ray'\n")
    assert not (tmp_path / "run").exists()
