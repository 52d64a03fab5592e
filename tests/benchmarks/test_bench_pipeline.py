"""``benchmarks/bench_pipeline.py`` in a few seconds: real generator actors around the fake engine
(``benchmarks/fake_engine.py``, which must keep up with what the generator reads of an engine), both
loops to their end, every figure in the JSON; the timings themselves are not asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.timeouts import guard

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_pipeline.py"


@pytest.mark.integration
def test_both_loops_train_every_sample_with_no_protocol_error_or_log_problem(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    run_benchmark([sys.executable, str(BENCH), "--steps", "2", "--batch-groups", "4", "--n", "4",
                   "--train-s", "0.1", "--json", str(out)], timeout_s=guard(300))
    result = json.loads(out.read_text())
    for loop in ("sync", "async"):
        assert result[loop]["trained_samples"] == 2 * 4 * 4, result[loop]
    assert result["protocol_errors"] == 0 and result["generator_log_problems"] == 0, result
    assert result["max_staleness"] <= 1 and isinstance(result["generator_idle_fraction"], float), result
