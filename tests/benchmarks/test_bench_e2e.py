"""``benchmarks/bench_e2e.py --quick``: the end-to-end benchmark's smoke run on a tiny random-weight
checkpoint, as CI runs it — real launches of both specroll arms and, where TRL is installed, the TRL
arm — checked on the JSON it writes and on the processes it leaves (none); and ``--precision``: the
overrides each precision gives the specroll arms and the TRL arm's job, and what it refuses."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from bench_e2e import parse_args, settings_from
from e2e_settings import check_comparable, resolved_config, run_sets
from e2e_trl import trl_job
from helpers.bench_runs import run_benchmark
from helpers.launch import live, members_of_groups, started_pids

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


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_precision_sets_the_trainer_and_generators_of_every_arm(precision: str, dtype: str) -> None:
    s = settings_from(parse_args(["--quick", "--model", "TINY", "--precision", precision]))
    for arm in ("sync", "specroll"):
        sets = run_sets(s, 0, Path("RUN"), arm)
        assert f'trainer.precision="{precision}"' in sets and f'generator.engine.dtype="{dtype}"' in sets
        c = resolved_config(s, 0, Path("RUN"), arm)  # the precision's dtype, not --quick's tiny-run sets'
        assert (c.trainer.precision, c.generator.engine.dtype, c.model.dtype) == (precision, dtype, "float32")
        assert c.drafter.warm_start_minutes == 0  # the example's warm start: a one-time cost no other arm has
        check_comparable(c, s.precision)
    job = trl_job(resolved_config(s, 0, Path("RUN"), "trl"), 2, Path("OUT"))  # TRL: bf16=(precision == "bf16")
    assert job["precision"] == precision and job["engine"]["dtype"] == dtype  # its evaluation engine too


def test_default_precision_is_bf16_and_others_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_from(parse_args([])).precision == "bf16"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--precision", "fp16"])
    assert exc.value.code == 2 and "--precision: invalid choice: 'fp16'" in capsys.readouterr().err


@pytest.mark.parametrize("override", ['generator.engine.dtype="float32"', 'trainer.precision="fp32"',
                                      'model.dtype="bfloat16"'])
def test_an_override_that_undoes_the_precision_is_refused(override: str) -> None:
    s = settings_from(parse_args(["--precision", "bf16", "--set", override]))
    with pytest.raises(ValueError, match=override.split("=")[0]):
        check_comparable(resolved_config(s, 0, Path("RUN"), "specroll"), s.precision)


@pytest.mark.integration  # starts the benchmark, which starts the arms' processes
@pytest.mark.slow
def test_quick_run_measures_every_arm_and_leaves_no_process(tmp_path: Path, tiny_checkpoint) -> None:
    out, work = tmp_path / "out.json", tmp_path / "work"
    cmd = [sys.executable, str(BENCH), "--quick", "--model", str(tiny_checkpoint()), "--json", str(out),
           "--workdir", str(work)]
    log, pid = run_benchmark(cmd, TIMEOUT_S)

    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["settings"]["steps"] == 2 and doc["settings"]["seeds"] == [0]
    assert doc["settings"]["precision"] == "bf16" and "precision bf16: TRL bf16=True" in log
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
        assert runs["trl"]["extra"]["engine_dtype"] == "bfloat16"
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
