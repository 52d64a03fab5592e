"""``benchmarks/bench_e2e.py --quick``: the end-to-end benchmark's smoke run on a tiny random-weight
checkpoint, as CI runs it — real launches of both specroll arms and, where TRL is installed, the TRL
arm — checked on the JSON it writes and on the processes it leaves (none)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.launch import live, members_of_groups, started_pids

pytestmark = pytest.mark.integration  # every test here starts a process

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_e2e.py"
TIMEOUT_S = 900  # three arms of two steps on a loaded 2-core machine take about a minute


def check_arm(run: dict, steps: int) -> None:
    """A measured run: a reward per step, an evaluation before training and after every step, a time."""
    assert run["status"] == "ok", run["reason"]
    assert len(run["rewards"]) == steps and all(0.0 <= r <= 1.0 for r in run["rewards"])
    assert [e["step"] for e in run["eval_accuracy"]] == list(range(steps + 1))
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in run["eval_accuracy"])
    assert run["samples"] == steps * 2 * 2 and run["samples_per_s"] > 0 and run["wall_s"] > 0
    assert len(run["step_end_s"]) == steps and run["step_end_s"] == sorted(run["step_end_s"])


@pytest.mark.slow
def test_quick_run_measures_every_arm_and_leaves_no_process(tmp_path: Path, tiny_checkpoint) -> None:
    out, work = tmp_path / "out.json", tmp_path / "work"
    cmd = [sys.executable, str(BENCH), "--quick", "--model", str(tiny_checkpoint()), "--json", str(out),
           "--workdir", str(work)]
    log, pid = run_benchmark(cmd, TIMEOUT_S)

    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["settings"]["steps"] == 2 and doc["settings"]["seeds"] == [0]
    runs = {r["arm"]: r for r in doc["runs"]}
    assert set(runs) == {"trl", "sync", "specroll"}
    check_arm(runs["sync"], 2)
    check_arm(runs["specroll"], 2)
    ratios = doc["summary"]["ratios"]
    assert ratios["specroll/sync"] > 0
    if runs["trl"]["status"] == "skipped":
        assert "trl" in runs["trl"]["reason"] and doc["versions"]["trl"] is None
        assert not any("trl" in name for name in ratios)
    else:
        check_arm(runs["trl"], 2)
        assert 0 < runs["trl"]["wall_s_without_eval"] < runs["trl"]["wall_s"]
        assert ratios["specroll/trl"] > 0 and ratios["sync/trl"] > 0
    assert "the whole benchmark took" in log

    # nothing left: the benchmark, its launchers and every role they started (and their process groups);
    # a killed process leaves /proc once reaped, a moment later on a loaded machine: polled for
    started = {arm: set(started_pids(work / f"{arm}-seed0" / "run").values()) for arm in ("sync", "specroll")}

    def leftovers() -> set[int]:
        return members_of_groups({pid}) | {p for pids in started.values() for p in live(pids)} \
            | members_of_groups({p for pids in started.values() for p in pids})

    deadline = time.monotonic() + 30  # a hang guard; normally the first look finds nothing
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not members_of_groups({pid}), "processes left in the benchmark's process group"
    for arm, pids in started.items():
        assert not live(pids) and not members_of_groups(pids), f"{arm}: processes left running"
