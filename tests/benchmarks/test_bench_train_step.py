"""``benchmarks/bench_train_step.py --quick``: the training-step profile's smoke run on a tiny
random-weight checkpoint — every arm timed by phase and as a whole, the phases adding up to about the
step, and a bad arm refused before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.timeouts import guard

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"
PHASES = ("pack", "forward", "head_forward", "head_backward", "backward", "optimizer")


@pytest.mark.integration
def test_quick_run_times_every_arm_by_phase(tmp_path: Path, tiny_checkpoint) -> None:
    out = tmp_path / "step.json"
    arms = ["fp32:0:1:loop", "bf16:8:1", "bf16:8:2"]
    log, _ = run_benchmark([sys.executable, str(BENCH), "--quick", "--model", str(tiny_checkpoint()),
                            "--arms", *arms, "--json", str(out)], timeout_s=guard(600))
    doc = json.loads(out.read_text())
    assert [a["name"] for a in doc["arms"]] == ["fp32, whole head, 1t, loop", "bf16, chunk 8, 1t, fused",
                                                "bf16, chunk 8, 2t, fused"]
    assert doc["response_tokens"] > 8 and doc["grad_accum_steps"] == 2  # the example's [trainer]: chunks split
    for name, m in doc["medians"].items():
        assert m["step_s"] > 0 and all(m[p] >= 0 for p in PHASES), name
        assert m["forward"] > 0 and m["backward"] > 0 and m["optimizer"] > 0, name
        assert len(doc["records"][name]) == doc["rounds"] == 2
    assert doc["medians"]["fp32, whole head, 1t, loop"]["speedup"] == 1.0
    assert "at 2 thread(s)" not in log  # no 2-thread baseline given, so no equal-thread ratio at 2


@pytest.mark.integration  # runs the script
@pytest.mark.parametrize(("args", "message"), [
    (["--arms", "fp16:0:1"], "precision 'fp16'"), (["--arms", "bf16:-1:1"], "chunk -1"),
    (["--arms", "bf16:8:0"], "threads 0"), (["--arms", "bf16:8:100000"], "threads 100000 (expected 1 to 1024)"),
    (["--arms", "bf16:8:1:adam"], "AdamW 'adam'"), (["--arms", "bf16:8"], "expected PRECISION:CHUNK:THREADS"),
    (["--max-tokens", "0"], "--max-tokens 0"), (["--json", "/nonexistent/x.json"], "/nonexistent does not exist"),
    (["--config", "/nonexistent.toml"], "no such file"), (["--model", "/nonexistent"], "'/nonexistent'"),
])
def test_bad_arguments_are_refused_before_anything_runs(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
