"""``benchmarks/bench_overhead.py --metrics`` in a few seconds: a 2-layer model, two batch sizes, the
metrics arm's rounds alternating off and on while a client scrapes the real ``/metrics`` endpoint;
every figure the docs quote is in the JSON (the timings themselves are not asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.timeouts import guard

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_overhead.py"


@pytest.mark.integration
def test_the_metrics_arm_scrapes_and_reports_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    run_benchmark([sys.executable, str(BENCH), "--batch-sizes", "1,4", "--layers", "2", "--steps", "3", "--rounds", "2",
                   "--metrics", "--metrics-round-s", "0.3", "--scrape-interval-s", "0.1", "--json", str(out)],
                  timeout_s=guard(300))
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["scrape_interval_s"] == 0.1
    assert set(metrics["batch"]) == {"1", "4"}
    for figures in metrics["batch"].values():
        assert figures["on"]["scrapes"] > 0 and figures["off"]["scrapes"] == 0, figures
        assert figures["on"]["step_ms"] > 0 and figures["off"]["step_ms"] > 0
        for key in ("on_over_off", "latency_share", "scrape_share"):
            assert isinstance(figures[key], float), key
