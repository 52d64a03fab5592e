"""Chaos benchmark: one ``specroll launch`` run on a tiny model during which generators are SIGKILLed
again and again — at random moments (mid-chunk), right after a generator started fetching a policy
version, right after it started fetching a drafter version, right after a restarted one rejoined —
and the drafter trainer and the trainer once each; the launcher restarts them all.

It checks, from the run's own records (``chaos_checks.py``): every prompt position trained exactly
once (0 lost, 0 duplicated), every resumed rollout beginning with exactly the tokens streamed before
the kill, the staleness bound (max lag ≤ η), the launcher's exit 0; and it measures the wall-time cost
against the same run without kills, run first (``--no-baseline`` skips it)::

    python benchmarks/bench_chaos.py --json chaos.json            # ~300 groups, 20 generator kills
    python benchmarks/bench_chaos.py --quick --json chaos.json    # CI: tests/benchmarks/test_bench_chaos.py

The model is a 2-layer random-weight Llama written to the work directory (``tiny_model.py``), unless
``--model`` names a checkpoint. Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from chaos_checks import ChaosChecks, check_run
from tiny_model import write_tiny_llama

KILL_KINDS = ("mid-chunk", "mid-weights-fetch", "mid-drafter-swap", "after-rejoin")
MARKERS = {"mid-weights-fetch": "fetching policy version", "mid-drafter-swap": "fetching drafter version",
           "after-rejoin": "welcomed by"}
"""The generator log line each kind of kill waits for (it kills right after the line appears)."""


@dataclass(frozen=True)
class Plan:
    """The run and its kills."""

    groups: int
    generators: int
    kills: int
    batch_groups: int = 4
    group_size: int = 4
    max_tokens: int = 48
    max_staleness: int = 1
    fork_roles: bool = True
    """``launch.fork_roles``: roles forked from the launcher, or fresh interpreters."""
    event_wait_s: float = 20.0
    """How long a kill waits for its moment (a log line) before it kills at a random moment instead."""

    @property
    def steps(self) -> int:
        return max(2, self.groups // self.batch_groups)

    def schedule(self) -> list[Slot]:
        """The kills in order: generator kills cycling through ``KILL_KINDS``, the drafter trainer's
        a third of the way and the trainer's two thirds of the way, due at steps spread evenly from
        step 1 to about 70% of the run (``Chaos.run``)."""
        kinds = [KILL_KINDS[i % len(KILL_KINDS)] for i in range(self.kills)]
        kinds.insert(len(kinds) // 3, "drafter")
        kinds.insert(2 * len(kinds) // 3, "trainer")
        last = max(1, int(0.7 * self.steps))
        due = [1 + (i * (last - 1)) // max(1, len(kinds) - 1) for i in range(len(kinds))]
        give_up = [max(d + 1, n) for d, n in zip(due, [*due[1:], due[-1] + 1], strict=True)]
        return [Slot(kind, d, g) for kind, d, g in zip(kinds, due, give_up, strict=True)]


@dataclass(frozen=True)
class Slot:
    """One kill of the schedule: what it kills, the step it waits for, the step its wait ends at."""

    kind: str
    step: int
    give_up_step: int


FULL = Plan(groups=320, generators=3, kills=20)
QUICK = Plan(groups=40, generators=2, kills=3, event_wait_s=10.0)


def run_config(plan: Plan, model: Path, run_dir: Path, seed: int) -> str:
    """The launched run: tiny model, checkpoints every step, a drafter trained online, quick restarts."""
    return f"""
run_dir = {json.dumps(str(run_dir))}
seed = {seed}
steps = {plan.steps}

[model]
name = {json.dumps(str(model))}

[task]
builtin_count = {max(64, plan.groups * 2)}

[trainer]
batch_groups = {plan.batch_groups}
group_size = {plan.group_size}
max_groups_in_flight = {2 * plan.batch_groups}
max_staleness = {plan.max_staleness}
checkpoint_every = 1
train_threads = 1

[generator]
count = {plan.generators}
heartbeat_s = 0.5
speculative = "eagle"
stream_every_steps = 2

[generator.engine]
dtype = "float32"
kv_cache_memory_gb = 0.02
max_num_seqs = 16
num_threads = 1

[generator.sampling]
max_tokens = {plan.max_tokens}

[drafter]
enabled = true
min_rollouts = 2
publish_every_steps = 2
window_tokens = 16
draft_vocab_size = 64
duty_cycle = 0.5

[eval]
every = 0

[launch]
max_restarts = {plan.kills + 10}
restart_backoff_s = 0.5
restart_backoff_max_s = 2.0
fork_roles = {str(plan.fork_roles).lower()}
"""


@dataclass
class Kill:
    t: float
    """Seconds after the launch."""
    role: str
    pid: int
    kind: str
    log_offset: int = 0
    """The size of the role's log at the kill: what its restart writes comes after."""
    wall: float = 0.0
    """``time.time()`` at the kill."""
    back_s: float | None = None
    """Seconds from the kill to the restarted generator's ``welcomed by`` line (None: not back)."""


@dataclass
class RunOutcome:
    exit_code: int
    wall_s: float
    kills: list[Kill] = field(default_factory=list)
    checks: ChaosChecks | None = None
    restart_lines: int = 0


class Chaos:
    """Kills processes of a launched run (module docstring), each at its kind of moment."""

    def __init__(self, run_dir: Path, launcher: subprocess.Popen[bytes], rng: random.Random, plan: Plan) -> None:
        self.run_dir, self.launcher, self.rng, self.plan = run_dir, launcher, rng, plan
        self.start = time.monotonic()
        self.kills: list[Kill] = []
        self.kill_offsets: dict[str, int] = {}
        """Each role's log size when it was last killed: what its restart writes comes after."""

    def running(self) -> bool:
        return self.launcher.poll() is None

    def pids(self) -> dict[str, int]:
        try:
            return json.loads((self.run_dir / "pids.json").read_text())["processes"]
        except (OSError, ValueError, KeyError):
            return {}

    def log_size(self, role: str) -> int:
        try:
            return (self.run_dir / "logs" / f"{role}.log").stat().st_size
        except OSError:
            return 0

    def new_text(self, role: str, offset: int) -> str:
        try:
            with (self.run_dir / "logs" / f"{role}.log").open("rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def live_pid(self, role: str) -> int | None:
        """``role``'s current process, or None while it is down (killed here, not yet restarted)."""
        pid = self.pids().get(role)
        return None if pid is None or pid in {k.pid for k in self.kills} else pid

    def kill(self, role: str, kind: str) -> bool:
        """SIGKILL ``role``'s process, waiting (while the run lasts) for it to be up if it is down."""
        while (pid := self.live_pid(role)) is None:
            if not self.running():
                return False
            time.sleep(0.02)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        offset = self.log_size(role)
        self.kills.append(Kill(round(time.monotonic() - self.start, 2), role, pid, kind, offset, time.time()))
        self.kill_offsets[role] = offset
        print(f"chaos: {time.monotonic() - self.start:7.1f} s  SIGKILL {role} (pid {pid}) {kind}", flush=True)
        return True

    def wait_marker(self, roles: list[str], marker: str, give_up_at_step: int,
                    after: dict[str, int] | None = None) -> str | None:
        """The first of ``roles`` whose log shows ``marker`` after now (or after the offsets ``after``),
        within ``event_wait_s`` and before the trainer logs step ``give_up_at_step``."""
        offsets = {r: self.log_size(r) for r in roles} | (after or {})
        deadline = time.monotonic() + self.plan.event_wait_s
        while time.monotonic() < deadline and self.running() and self.step() < give_up_at_step:
            for role in roles:
                if marker in self.new_text(role, offsets[role]):
                    return role
            time.sleep(0.005)
        return None

    def kill_generator(self, kind: str, give_up_at_step: int) -> None:
        generators = [f"generator-{i}" for i in range(self.plan.generators)]
        if kind == "after-rejoin":  # the one killed last, once its restart is welcomed again
            last = next((k.role for k in reversed(self.kills) if k.role.startswith("generator")), None)
            roles = [last] if last is not None else generators
        else:
            roles = self.rng.sample(generators, len(generators))
        if kind in MARKERS:
            rejoin = kind == "after-rejoin"
            after = {r: self.kill_offsets[r] for r in roles if r in self.kill_offsets} if rejoin else None
            role = self.wait_marker(roles, MARKERS[kind], give_up_at_step, after)
            if role is not None:
                self.kill(role, kind)
                return
            kind = f"mid-chunk ({kind} not seen in time)"
        up = [r for r in roles if self.live_pid(r) is not None]
        self.kill(self.rng.choice(up or roles), kind)

    def step(self) -> int:
        """The highest step the trainer has logged so far (0 before the first)."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        steps = [0]
        for line in lines:
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line being written
        return max(steps)

    def wait_step(self, step: int) -> None:
        while self.running() and self.step() < step:
            time.sleep(0.02)

    def run(self) -> None:
        """Kill on the plan's schedule until it is done or the run ends.

        Kills are paced by training progress, not by the clock, so every kill lands inside the run
        however fast the machine is: kill i waits for step ``schedule[i].step``, and a kill that waits
        for its moment (a log line) gives up at the next kill's step, when it kills at a random moment
        instead. The last kill is due at about 70% of the steps."""
        for slot in self.plan.schedule():
            self.wait_step(slot.step)
            if not self.running():
                break
            if slot.kind == "drafter":
                self.kill("drafter", "drafter trainer")
            elif slot.kind == "trainer":
                self.kill("trainer", "trainer")
            else:
                self.kill_generator(slot.kind, give_up_at_step=slot.give_up_step)


def time_back(log: Path, kill: Kill) -> float | None:
    """Seconds from ``kill`` to the first ``welcomed by`` line its role's log has after it (the
    restarted generator registered with the trainer again), from the log's own timestamps."""
    with log.open("rb") as f:
        f.seek(kill.log_offset)
        for line in f.read().decode(errors="replace").splitlines():
            if "welcomed by" in line:
                try:
                    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                return round(stamp - kill.wall, 2)
    return None


def launch_run(plan: Plan, model: Path, work: Path, name: str, seed: int, chaos: bool) -> RunOutcome:
    """One launched run in ``work/name``; with ``chaos``, the kills of the plan."""
    run_dir = work / name
    config = work / f"{name}.toml"
    config.write_text(run_config(plan, model, run_dir, seed))
    err_path = work / f"{name}.launcher.log"
    start = time.monotonic()
    with err_path.open("wb") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "specroll.actors.cli", "launch", str(config)],
                                    stdout=subprocess.DEVNULL, stderr=err)
        kills: list[Kill] = []
        try:
            if chaos:
                c = Chaos(run_dir, launcher, random.Random(seed), plan)
                c.run()
                kills = c.kills
            code = launcher.wait()
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)  # the launcher tears its run down
                launcher.wait()
    wall = time.monotonic() - start
    for k in kills:
        if k.role.startswith("generator"):
            k.back_s = time_back(run_dir / "logs" / f"{k.role}.log", k)
    text = err_path.read_text(errors="replace")
    outcome = RunOutcome(code, wall, kills, restart_lines=text.count("; restart "))
    if code == 0:
        outcome.checks = check_run(run_dir)
    else:
        print(f"chaos: the {name} run exited {code}; launcher output in {err_path}:\n{text[-3000:]}", flush=True)
    return outcome


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--model", type=Path, help="a checkpoint directory (default: a tiny random Llama)")
    p.add_argument("--quick", action="store_true", help="CI size: ~40 groups, 2 generators, 3 generator kills")
    p.add_argument("--groups", type=int, help="groups to train (default 320; quick 40)")
    p.add_argument("--kills", type=int, help="generator kills (default 20; quick 3)")
    p.add_argument("--generators", type=int, help="generators (default 3; quick 2)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without kills (no overhead figure)")
    p.add_argument("--fresh-interpreters", action="store_true",
                   help="launch.fork_roles = false: every start and restart is a new python -m process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: a launched run is torn down
    base = QUICK if a.quick else FULL
    plan = Plan(groups=a.groups or base.groups, generators=a.generators or base.generators,
                kills=base.kills if a.kills is None else a.kills, event_wait_s=base.event_wait_s,
                fork_roles=not a.fresh_interpreters)
    if plan.generators < 2 or plan.groups < 8 or plan.kills < 0:
        p.error(f"--generators {plan.generators} (>= 2), --groups {plan.groups} (>= 8), --kills {plan.kills} (>= 0)")
    with tempfile.TemporaryDirectory(prefix="specroll-chaos-") as tmp:
        work = a.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = a.model or write_tiny_llama(work / "tiny-llama")
        baseline = None
        if not a.no_baseline:
            baseline = launch_run(plan, model, work, "baseline", a.seed, chaos=False)
            print(f"chaos: baseline (no kills) exited {baseline.exit_code} in {baseline.wall_s:.1f} s", flush=True)
        chaos = launch_run(plan, model, work, "chaos", a.seed, chaos=True)
    return report(plan, chaos, baseline, a.json)


def report(plan: Plan, chaos: RunOutcome, baseline: RunOutcome | None, json_path: Path | None) -> int:
    """Print the figures (and write them to ``json_path``); 0 when every check passed."""
    checks = chaos.checks
    overhead = chaos.wall_s / baseline.wall_s - 1 if baseline and baseline.exit_code == 0 else None
    generator_kills = [k for k in chaos.kills if k.role.startswith("generator")]
    back = sorted(k.back_s for k in generator_kills if k.back_s is not None)
    ok = chaos.exit_code == 0 and checks is not None and checks.ok and checks.max_staleness <= plan.max_staleness
    result = {
        "ok": ok, "plan": plan.__dict__, "exit_code": chaos.exit_code, "wall_s": round(chaos.wall_s, 1),
        "baseline_wall_s": round(baseline.wall_s, 1) if baseline else None,
        "baseline_exit_code": baseline.exit_code if baseline else None,
        "overhead": round(overhead, 3) if overhead is not None else None,
        "kills": [k.__dict__ for k in chaos.kills], "generator_kills": len(generator_kills),
        "generator_back_s": {"median": back[len(back) // 2] if back else None, "max": back[-1] if back else None,
                             "back": len(back)},
        "fork_roles": plan.fork_roles,
        "restart_lines": chaos.restart_lines, "checks": checks.to_json() if checks else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_1m": os.getloadavg()[0]},
    }
    print(f"chaos: {len(generator_kills)} generator kills, {len(chaos.kills) - len(generator_kills)} other; "
          f"{chaos.restart_lines} restarts; exit {chaos.exit_code}")
    if back:
        print(f"chaos: a killed generator was welcomed back after {back[len(back) // 2]:.1f} s (median; max "
              f"{back[-1]:.1f} s, back-off included; {len(back)} of {len(generator_kills)} came back before the end)")
    if checks is not None:
        print(f"chaos: {checks.groups_trained} groups in {checks.steps} steps; lost {len(checks.lost)}, "
              f"duplicated {len(checks.duplicated) + len(checks.duplicated_groups)}; {checks.resumes} resumes, "
              f"{checks.resumes_checked} resumed samples checked, {len(checks.resume_mismatches)} mismatched; "
              f"max staleness {checks.max_staleness} (eta {plan.max_staleness}); "
              f"{checks.trainer_starts} trainer starts")
    if overhead is not None:
        print(f"chaos: wall {chaos.wall_s:.1f} s vs {baseline.wall_s:.1f} s without kills: overhead "  # type: ignore[union-attr]
              f"{100 * overhead:.1f}% (target < 25%)")
    print(f"chaos: {'PASS' if ok else 'FAIL'}")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
