"""Agentic RL with a slow tool: specroll off-step vs specroll synchronous vs a plain synchronous loop.

The built-in calculator task (``examples/agentic_smollm2.toml``: two-digit products, a calculator tool)
trained three ways on the same work, each tool call answered after a lognormal latency (``--latency
MEDIAN:P99`` seconds; ``0:0`` is the zero-latency control):

* ``offstep``: ``specroll launch`` on the example: episodes run while the trainer trains; the feeder
  keeps up to (η + 1)·B groups ahead of the step (``--staleness`` η);
* ``sync``: the same with ``trainer.mode = "sync"``: start a step's groups, wait for every episode,
  train, publish, wait until the generator serves the new weights;
* ``loop``: ``agentic_loop.py``: a plain loop over the ``openai`` client against ``specroll serve``
  with TRL-style batching (the whole batch, then train, then ``POST /update_weights``).

Arms run one after another, interleaved (for each round, each latency: offstep, sync, loop). Per arm:
trained episodes per second between the end of the first step and the end of the last (start-up and
the first step's ramp left out), the generator's idle share over that span (its process's CPU time,
sampled from ``/proc``: the time the generator waits on tools, training and publishing), and the
held-out accuracy before and after (32 prompts, one episode each, fixed seeds). Prints a table and the
ratios offstep/sync and offstep/loop; writes ``OUT/results.json``.

    python benchmarks/bench_agentic.py --steps 12 --latency 1:10 --latency 0:0 --out runs/bench_agentic
    python benchmarks/bench_agentic.py --quick --model DIR   # CI smoke test on a tiny checkpoint

What bounds the ratio: off-step hides a tool's latency behind other episodes' generation and the
training step, so its throughput is bounded by compute; a synchronous step costs compute plus the
slowest episode's tool waits. With compute C per step and a step's tool tail W (the longest chain of
tool latencies among its B·n episodes), sync ≈ C + W and off-step ≈ max(C, W / (groups ahead)) per
step: the ratio tends to (C + W) / C when enough groups are ahead — not more.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "agentic_smollm2.toml"
ARMS = ("offstep", "sync", "loop")
TINY = ("generator.engine.kv_cache_memory_gb=0.02", "generator.engine.max_num_seqs=8", "generator.heartbeat_s=0.5",
        "generator.sampling.max_tokens=8", "eval.count=4", "task.max_turns=2")


def _sets(args: argparse.Namespace, run_dir: Path, latency: tuple[float, float], arm: str) -> list[str]:
    median, p99 = latency
    sets = [f'run_dir="{run_dir}"', f"steps={args.steps}", f"seed={args.seed}", f"eval.every={args.steps}",
            f"task.tool_latency_median_s={median}", f"task.tool_latency_p99_s={p99}",
            f"trainer.max_staleness={args.staleness}",
            f"trainer.max_groups_in_flight={(args.staleness + 1) * 2}", "generator.engine.num_threads=1"]
    if args.model:
        sets.append(f'model.name="{args.model}"')
    if args.quick:
        sets += [*TINY, "trainer.group_size=2", "trainer.batch_groups=1", "trainer.max_groups_in_flight=2"]
    if arm == "sync":
        sets.append('trainer.mode="sync"')
    return sets


class _CpuSampler:
    """Polls the CPU seconds (user + system) of a process named in ``RUN_DIR/pids.json`` twice a second."""

    def __init__(self, pids_file: Path, role: str) -> None:
        self.pids_file, self.role, self.samples = pids_file, role, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.5):
            try:
                pid = json.loads(self.pids_file.read_text())["processes"][self.role]
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                self.samples.append((time.time(), (int(fields[11]) + int(fields[12])) / tick))
            except (OSError, ValueError, KeyError):
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, start: float, end: float) -> float | None:
        """CPU seconds per wall second between ``start`` and ``end`` (Unix times)."""
        inside = [(t, c) for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None


def _run(cmd: list[str], log: Path, timeout_s: float) -> int | None:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None


def run_arm(args: argparse.Namespace, arm: str, latency: tuple[float, float], workdir: Path) -> dict[str, Any]:
    """One arm on one latency: its figures, or ``{"status": "failed", ...}``."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / "run"
    sets = _sets(args, run_dir, latency, arm)
    if arm == "loop":
        from specroll.actors.config import load_config, write_resolved

        config = load_config(EXAMPLE, sets)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_resolved(config)
        cmd = [sys.executable, str(ROOT / "benchmarks" / "agentic_loop.py"), "--config", str(run_dir / "config.toml"),
               "--out", str(workdir)]
        pids = workdir / "serve" / "pids.json"
    else:
        cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(EXAMPLE),
               *(x for s in sets for x in ("--set", s))]
        pids = run_dir / "pids.json"
    sampler = _CpuSampler(pids, "generator-0")
    code = _run(cmd, workdir / "arm.log", args.arm_timeout_s)
    sampler.stop()
    if code != 0:
        tail = (workdir / "arm.log").read_text(errors="replace").splitlines()[-12:]
        return {"arm": arm, "status": "failed", "reason": f"exit {code}", "log_tail": tail}
    if arm == "loop":
        steps = [json.loads(line) for line in (workdir / "steps.jsonl").read_text().splitlines()]
        result = json.loads((workdir / "result.json").read_text())
        before, after = result["eval_before"], result["eval_after"]
    else:
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in lines if m["step"] > 0 and not m.get("skipped")]
        evals = [m for m in lines if "eval_accuracy" in m]
        before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    first, last = steps[0]["time"], steps[-1]["time"]
    episodes = sum(s["episodes"] for s in steps[1:])
    busy = sampler.busy(first, last)
    return {"arm": arm, "status": "ok", "steps": len(steps), "span_s": last - first,
            "episodes_per_s": episodes / (last - first) if last > first else None,
            "generator_idle": None if busy is None else max(0.0, 1.0 - busy),
            "eval_before": before, "eval_after": after,
            "reward_mean": [s["reward_mean"] for s in steps]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--latency", action="append", default=None, help="MEDIAN:P99 seconds (repeatable)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--staleness", type=int, default=1, help="trainer.max_staleness η (all arms)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model.name (default: the example's)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_agentic")
    parser.add_argument("--arm-timeout-s", type=float, default=3600)
    parser.add_argument("--quick", action="store_true", help="a CI smoke run (2 steps; use with a tiny --model)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in ARMS]
    latencies = []
    for text in args.latency or ["1:10", "0:0"]:
        try:
            median, p99 = (float(x) for x in text.split(":"))
            if not 0 <= median <= p99 or (median == 0 and p99 != 0):
                raise ValueError
        except ValueError:
            parser.error(f"--latency {text!r}: expected MEDIAN:P99 seconds with 0 <= MEDIAN <= P99 (0:0: none)")
        latencies.append((median, p99))
    if bad or args.steps < 2 or args.rounds < 1 or args.staleness < 0:
        parser.error(f"arms {bad} (expected {ARMS}), --steps {args.steps} (>= 2), --rounds {args.rounds} (>= 1), "
                     f"--staleness {args.staleness} (>= 0)")
    if args.quick:
        args.steps = 2
    results = []
    for r in range(args.rounds):
        for median, p99 in latencies:
            for arm in arms:
                workdir = args.out / f"round{r}" / f"latency{median:g}-{p99:g}" / arm
                print(f"round {r}, latency {median:g}/{p99:g} s: {arm} ...", file=sys.stderr, flush=True)
                result = run_arm(args, arm, (median, p99), workdir)
                result.update(round=r, latency=[median, p99])
                results.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "reward_mean"}), file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    _report(results, latencies, arms)
    return 0 if all(r["status"] == "ok" for r in results) else 1


def _report(results: list[dict[str, Any]], latencies: list[tuple[float, float]], arms: list[str]) -> None:
    def mean(values: list[float]) -> float | None:
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def fmt(value: float | None, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'latency':>10} {'arm':>8} {'episodes/s':>11} {'gen idle':>9} {'eval before':>12} {'eval after':>11}")
    for median, p99 in latencies:
        rate = {}
        for arm in arms:
            ok = [r for r in results if r["arm"] == arm and r["latency"] == [median, p99] and r["status"] == "ok"]
            rate[arm] = mean([r["episodes_per_s"] for r in ok])
            print(f"{f'{median:g}/{p99:g} s':>10} {arm:>8} {fmt(rate[arm]):>11} "
                  f"{fmt(mean([r['generator_idle'] for r in ok]), '.0%'):>9} "
                  f"{fmt(mean([r['eval_before'] for r in ok])):>12} {fmt(mean([r['eval_after'] for r in ok])):>11}")
        for other in ("sync", "loop"):
            if rate.get("offstep") and rate.get(other):
                print(f"{'':>10} offstep/{other}: {rate['offstep'] / rate[other]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
