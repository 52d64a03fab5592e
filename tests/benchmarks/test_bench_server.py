"""``benchmarks/bench_server.py --quick``: the server benchmark's smoke run on a tiny random-weight
checkpoint — a real generator process, specroll's server with the real ``openai`` client in client
processes, and the direct arm — checked on the JSON it writes (every arm measured every request, each
of exactly the asked tokens; the vLLM arm skipped with its reason) and on the processes it leaves (none)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.launch import live, members_of_groups

pytestmark = pytest.mark.integration  # every test here starts a process

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_server.py"
TIMEOUT_S = 600  # about 40 s on a loaded 2-core machine
ARMS = {"direct", "completions", "completions-stream", "chat", "chat-stream"}


@pytest.mark.slow
def test_quick_run_measures_every_arm_and_leaves_no_process(tmp_path: Path, tiny_checkpoint) -> None:
    pytest.importorskip("openai")
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--model", str(tiny_checkpoint()), "--json", str(out),
           "--workdir", str(tmp_path / "work")]
    log, pid = run_benchmark(cmd, TIMEOUT_S)

    doc = json.loads(out.read_text())
    assert doc["complete"], doc["failed"]
    settings = doc["settings"]
    expected = {(arm, c): n for arm in ARMS for c, n in zip(settings["concurrency"], settings["requests"], strict=True)}
    cells = {(c["arm"], c["concurrency"]): c for c in doc["cells"]}
    assert set(cells) == set(expected)
    for key, cell in cells.items():
        assert len(cell["samples"]) == expected[key], key
        assert all(s["completion_tokens"] == settings["max_tokens"] for s in cell["samples"]), key
        assert all(s["latency_s"] > 0 for s in cell["samples"]), key
        assert cell["wall_s"] > 0 and cell["server_cpu_s"] is not None and cell["engine_cpu_s"] is not None, key
        streamed = key[0] == "direct" or key[0].endswith("-stream")
        assert all((s["ttft_s"] is not None) == streamed for s in cell["samples"]), key
        assert (cell["client_cpu_s"] is None) == (key[0] == "direct"), key
    assert set(doc["summary"]["http_overhead"]) == ARMS - {"direct"}
    assert doc["vllm"]["status"] == "skipped" and "--vllm-python" in doc["vllm"]["reason"]
    assert "vllm arm skipped" in log and "HTTP overhead against direct" in log

    # nothing left: the benchmark's process group (its client processes) and the generator's own group
    generators = {p["pid"] for p in doc["processes"]}
    assert len(generators) == 1

    def leftovers() -> set[int]:
        return members_of_groups({pid} | generators) | live(generators)

    deadline = time.monotonic() + 30  # a hang guard; normally the first look finds nothing
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leftovers(), "processes of the benchmark left running"
