"""The engine's phase clock (``engine/phases.py``) and ``benchmarks/bench_overhead.py`` on a 2-layer model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.timeouts import guard

from specroll.engine.config import EngineConfig
from specroll.engine.engine import Engine
from specroll.engine.phases import PHASES
from specroll.protocol.sampling import SamplingParams

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_overhead.py"


def test_phase_clock_times_every_phase_of_the_steps_it_is_on_for(tiny_checkpoint):
    engine = Engine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory_gb=0.01,
                                 max_model_len=256))
    for i in range(3):
        engine.add_request([5 + i, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=20, seed=i), f"r{i}")
    engine.step()
    assert engine.phases.totals.steps == 0 and sum(engine.phases.totals.seconds.values()) == 0.0  # off
    engine.phases.enabled = True
    start = time.perf_counter()
    for _ in range(5):
        engine.step()
    wall = time.perf_counter() - start
    totals = engine.phases.totals
    assert totals.steps == 5 and list(totals.seconds) == list(PHASES)
    assert all(totals.seconds[p] > 0 for p in ("schedule", "metadata", "forward", "sample", "emit")), totals
    assert sum(totals.seconds.values()) <= wall  # consecutive intervals inside the steps
    per_step = totals.per_step_ms()
    assert per_step["forward"] == 1e3 * totals.seconds["forward"] / 5
    engine.phases.reset()
    assert engine.phases.totals.steps == 0


@pytest.mark.integration
def test_bench_overhead_reports_decode_and_verify_per_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, str(BENCH), "--layers", "2", "--batch-sizes", "1,3", "--steps", "4", "--rounds", "2",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=guard(600), cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["layers"] == 2 and set(report["batch"]) == {"1", "3"}
    for row in report["batch"].values():
        for mode in ("decode", "verify"):
            assert row[mode]["step_ms"] > 0 and len(row[mode]["round_medians_ms"]) == 2
            assert row[mode]["step_ms"] == min(row[mode]["round_medians_ms"])
            assert set(row[mode]["phases_ms"]) == set(PHASES)
        assert row["verify_over_decode"] == row["verify"]["step_ms"] / row["decode"]["step_ms"]
    assert "verify / decode" in done.stdout
