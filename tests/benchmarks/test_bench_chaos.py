"""``benchmarks/bench_chaos.py --quick``: a launched run on a tiny random model during which generators
(at random moments, mid-weights-fetch, mid-drafter-swap, right after one rejoined), the drafter
trainer and the trainer are SIGKILLed — the CI version of the chaos benchmark; with ``--network`` the
peers also reach the trainer through a fault relay that stalls, resets, leaves half-open and slows
their links, and the trainer is paused past their heartbeat timeout once. It must finish (exit 0)
with every prompt trained exactly once, every resumed rollout continuing the tokens it carried, the
staleness bound held, the trainer started only at the launch and after its kill, and no process left behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.launch import live, members_of_groups, started_pids
from helpers.timeouts import guard

pytestmark = pytest.mark.integration  # every test here starts a process

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_chaos.py"
TIMEOUT_S = 900  # about 2 minutes on a loaded 2-core machine (every restart imports torch again)


@pytest.mark.slow
@pytest.mark.parametrize("network", [False, True], ids=["kills", "kills-and-network-faults"])
def test_quick_chaos_run_trains_every_group_once(tmp_path: Path, network: bool) -> None:
    out, work = tmp_path / "chaos.json", tmp_path / "work"
    cmd = [sys.executable, str(BENCH), "--quick", "--no-baseline", "--json", str(out), "--work-dir", str(work)]
    log, pid = run_benchmark(cmd + ["--network"] * network, guard(TIMEOUT_S))

    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["exit_code"] == 0, log[-3000:]
    kinds = [k["role"] for k in doc["kills"]]
    assert kinds.count("trainer") == 1 and kinds.count("drafter") == 1, doc["kills"]
    assert doc["generator_kills"] == 3 and doc["restart_lines"] >= 5, doc["kills"]
    checks = doc["checks"]
    assert checks["lost"] == [] and checks["duplicated"] == [] and checks["duplicated_groups"] == []
    assert checks["resume_mismatches"] == [] and checks["max_staleness"] <= 1
    assert checks["trainer_starts"] == 2  # the first trainer and its restart from the checkpoint: no fault killed it
    if network:  # every kind of fault was made
        assert doc["fault_kinds"] == {"stall": 1, "reset": 1, "half-open": 1, "slow": 1, "trainer-pause": 1}
    assert checks["groups_trained"] >= doc["plan"]["groups"]

    run_dir = work / "chaos"
    pids = set(started_pids(run_dir).values()) | {k["pid"] for k in doc["kills"]}
    assert not live(pids), "a process of the run outlived the benchmark"
    assert not members_of_groups(pids | {pid})
