"""The specroll arms of ``bench_e2e.py``: ``specroll launch`` on the example config, read back from
``RUN_DIR/metrics.jsonl``.

``sync`` launches with ``trainer.mode="sync"`` (submit a step's groups, wait for every rollout, train,
publish, wait until every generator serves the new weights; no speculation, no drafter trainer);
``specroll`` launches the default asynchronous pipeline with speculation and the online drafter as
the example configures them. The arm's clock starts when the launcher is started, so its wall time
includes starting the processes and loading the model in each, as the TRL arm's includes its own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2e_results import ArmResult
from e2e_settings import EXAMPLE, Arm, Settings, run_sets

TERM_GRACE_S = 30.0
"""Seconds the launcher gets to tear its run down after SIGTERM before it is killed (its roles die with
it: the launcher gives each ``PR_SET_PDEATHSIG = SIGKILL``)."""


def run_specroll_arm(s: Settings, seed: int, arm: Arm, workdir: Path) -> ArmResult:
    """Launch one run of ``arm`` (``sync`` or ``specroll``) on ``seed`` and read its metrics; a launch that
    fails or times out is a ``failed`` result with the tail of its stderr."""
    run_dir = workdir / "run"
    workdir.mkdir(parents=True, exist_ok=True)
    sets = run_sets(s, seed, run_dir, arm)
    cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(EXAMPLE)]
    cmd += [x for v in sets for x in ("--set", v)]
    (workdir / "command.json").write_text(json.dumps(cmd))
    out, err = workdir / "launch.out", workdir / "launch.err"
    start = time.time()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e)
    try:
        code = proc.wait(timeout=s.arm_timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        _stop(proc)
    if code != 0:
        what = f"timed out after {s.arm_timeout_s:g} s" if code is None else f"exited {code}"
        tail = err.read_text(errors="replace").splitlines()[-15:]
        return ArmResult(arm, seed, status="failed", reason=f"{what}; {err}:\n" + "\n".join(tail))
    try:
        return read_run(run_dir, arm, seed, start, s.steps)
    except (OSError, ValueError, KeyError) as exc:  # json.JSONDecodeError is a ValueError
        return ArmResult(arm, seed, status="failed", reason=f"{run_dir}: unreadable run ({exc!r})")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher (it tears its run down), then SIGKILL after :data:`TERM_GRACE_S`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_run(run_dir: Path, arm: Arm, seed: int, start: float, steps: int) -> ArmResult:
    """An :class:`ArmResult` from a finished run's ``metrics.jsonl`` (steps, rewards, times) and
    ``timeline.jsonl`` (every ``evaluation`` event, and the trainer's ``eval_wait`` phases); ``start`` is
    ``time.time()`` when the launcher was started.

    The evaluations are read from the timeline: a metrics line carries at most one evaluation, and when
    two finish before the same line (the evaluation after step N-1 and the one after the last step N)
    the trainer writes only the second there.

    Raises:
        ValueError: the metrics do not hold exactly steps 1..``steps``.
    """
    path = run_dir / "metrics.jsonl"
    lines = [m for m in _jsonl(path) if m["step"] > 0]  # step 0: the evaluation before training
    if [m["step"] for m in lines] != list(range(1, steps + 1)):
        raise ValueError(f"{path}: expected steps 1..{steps}, got {[m['step'] for m in lines]}")
    events = _jsonl(run_dir / "timeline.jsonl")
    first, last = lines[0], lines[-1]
    span_start = first["time"] - first["step_s"] - first["wait_s"]
    return ArmResult(
        arm, seed, rewards=[m["reward_mean"] for m in lines], step_end_s=[m["time"] - start for m in lines],
        train_start_s=span_start - start,
        eval_accuracy={e["step"]: e["accuracy"] for e in events if e["event"] == "evaluation"},
        wall_s=last["time"] - start, trainer_span_s=last["time"] - span_start,
        eval_s=sum(e["end"] - e["start"] for e in events if e["event"] == "phase" and e["phase"] == "eval_wait"),
        samples=sum(m["samples"] for m in lines),
        extra={"step_s": [m["step_s"] for m in lines], "wait_s": [m["wait_s"] for m in lines],
               "response_tokens_mean": [m["response_tokens_mean"] for m in lines],
               "gen_tokens_per_s": [m["gen_tokens_per_s"] for m in lines],
               "acceptance_length": last.get("acceptance_length"), "max_lag": max(m["max_lag"] for m in lines),
               "logprob_diff_max": max((m["logprob_diff_max"] or 0.0) for m in lines)})


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
