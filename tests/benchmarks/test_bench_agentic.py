"""``benchmarks/bench_agentic.py --quick``: the agentic benchmark's smoke run on a tiny random-weight
checkpoint — the three arms (specroll off-step, specroll synchronous, the plain loop over the openai
client) each train, are evaluated before and after, and report their throughput and the generator's
idle share; bad arguments are refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.timeouts import guard

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_agentic.py"


@pytest.mark.integration
@pytest.mark.slow
def test_quick_run_trains_every_arm(tmp_path: Path, tiny_checkpoint) -> None:
    model = tiny_checkpoint(max_position_embeddings=2048)
    log, _ = run_benchmark([sys.executable, str(BENCH), "--quick", "--model", str(model), "--latency", "0.05:0.2",
                            "--out", str(tmp_path / "out")], timeout_s=guard(900))
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["arm"] for r in results] == ["offstep", "sync", "loop"]
    for r in results:
        assert r["status"] == "ok", r
        assert r["steps"] == 2 and r["episodes_per_s"] > 0 and len(r["reward_mean"]) == 2
        assert 0 <= r["eval_before"] <= 1 and 0 <= r["eval_after"] <= 1
    assert "offstep/sync:" in log and "offstep/loop:" in log


@pytest.mark.integration  # runs the script
@pytest.mark.parametrize(("args", "message"), [
    (["--latency", "10:1"], "--latency '10:1'"), (["--latency", "x"], "--latency 'x'"),
    (["--arms", "offstep,trl"], "arms ['trl']"), (["--steps", "1"], "--steps 1"),
])
def test_bad_arguments_are_refused(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=guard(60))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
