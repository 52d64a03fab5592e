"""Chaos benchmark: one ``specroll launch`` run on a tiny model during which generators are SIGKILLed
again and again — at random moments (mid-chunk), right after a generator started fetching a policy
version, right after it started fetching a drafter version, right after a restarted one rejoined —
and the drafter trainer and the trainer once each; the launcher restarts them all.

With ``--network`` every peer connects through a relay in front of the trainer (``fault_proxy.py``,
``network.peer_endpoint``) and network faults join the kills (``chaos_network.py``): one generator's
link stalled past the heartbeat timeouts, reset, or left half-open, every link slowed (delay and
throttle), and the trainer paused once past its peers' ZMTP timeout (SIGSTOP, SIGCONT).

It checks, from the run's own records (``chaos_checks.py``): every prompt position trained exactly
once (0 lost, 0 duplicated), every resumed rollout beginning with exactly the tokens streamed before
the kill, the staleness bound (max lag ≤ η), the trainer started only at the launch and after its
planned kill (it never died of a fault), the launcher's exit 0; and it measures the wall-time cost
against the same run without kills or faults, run first (``--no-baseline`` skips it; with
``--network`` it runs through the relay too)::

    python benchmarks/bench_chaos.py --json chaos.json              # ~300 groups, 20 generator kills
    python benchmarks/bench_chaos.py --network --json chaos.json    # and 12 network faults, a trainer pause
    python benchmarks/bench_chaos.py --quick --json chaos.json      # CI: tests/benchmarks/test_bench_chaos.py

The model is a 2-layer random-weight Llama written to the work directory (``tiny_model.py``), unless
``--model`` names a checkpoint. Exit 0 when every check passed, 1 otherwise. The run's size and its
kill schedule are in ``chaos_plan.py``, the killing in ``chaos_killer.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from chaos_checks import ChaosChecks, check_run
from chaos_killer import Chaos, Kill
from chaos_network import Fault, NetworkChaos
from chaos_plan import FULL, FULL_FAULTS, QUICK, QUICK_FAULTS, Plan, run_config
from fault_proxy import FaultProxy
from tiny_model import write_tiny_llama


@dataclass
class RunOutcome:
    exit_code: int
    wall_s: float
    kills: list[Kill] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    checks: ChaosChecks | None = None
    restart_lines: int = 0


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_run(plan: Plan, model: Path, work: Path, name: str, seed: int, chaos: bool, relay: bool) -> RunOutcome:
    """One launched run in ``work/name``; with ``chaos``, the kills and faults of the plan; with
    ``relay``, every peer connects through a fault relay in front of the trainer."""
    run_dir = work / name
    config = work / f"{name}.toml"
    port = free_port()
    proxy = FaultProxy(f"tcp://127.0.0.1:{port}").start() if relay else None
    config.write_text(run_config(plan, model, run_dir, seed, (port, proxy.endpoint) if proxy else None))
    err_path = work / f"{name}.launcher.log"
    start = time.monotonic()
    kills: list[Kill] = []
    network = None
    with err_path.open("wb") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "specroll.actors.cli", "launch", str(config)],
                                    stdout=subprocess.DEVNULL, stderr=err)
        try:
            if chaos:
                if proxy is not None:
                    network = NetworkChaos(proxy, plan, random.Random(seed + 1), start, lambda: launcher.poll() is None)
                c = Chaos(run_dir, launcher, random.Random(seed), plan, network)
                c.run()
                kills = c.kills
            if network is not None:
                network.close()
            code = launcher.wait()
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)  # the launcher tears its run down
                launcher.wait()
            if proxy is not None:
                proxy.close()
    wall = time.monotonic() - start
    for k in kills:
        if k.role.startswith("generator"):
            k.back_s = time_back(run_dir / "logs" / f"{k.role}.log", k)
    text = err_path.read_text(errors="replace")
    outcome = RunOutcome(code, wall, kills, network.faults if network else [], restart_lines=text.count("; restart "))
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
    p.add_argument("--network", action="store_true",
                   help="peers connect through a fault relay; network faults and a trainer pause join the kills")
    p.add_argument("--faults", type=int,
                   help=f"network faults with --network (default {FULL_FAULTS}; quick {QUICK_FAULTS})")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without kills (no overhead figure)")
    p.add_argument("--fresh-interpreters", action="store_true",
                   help="launch.fork_roles = false: every start and restart is a new python -m process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: a launched run is torn down
    base = QUICK if a.quick else FULL
    faults = (QUICK_FAULTS if a.quick else FULL_FAULTS) if a.faults is None else a.faults
    plan = Plan(groups=a.groups or base.groups, generators=a.generators or base.generators,
                kills=base.kills if a.kills is None else a.kills, event_wait_s=base.event_wait_s,
                fork_roles=not a.fresh_interpreters, faults=faults if a.network else 0)
    if plan.generators < 2 or plan.groups < 8 or plan.kills < 0 or plan.faults < 0:
        p.error(f"--generators {plan.generators} (>= 2), --groups {plan.groups} (>= 8), --kills {plan.kills} (>= 0), "
                f"--faults {plan.faults} (>= 0)")
    if a.faults is not None and not a.network:
        p.error(f"--faults {a.faults} without --network: the faults need the relay")
    with tempfile.TemporaryDirectory(prefix="specroll-chaos-") as tmp:
        work = a.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = a.model or write_tiny_llama(work / "tiny-llama")
        baseline = None
        if not a.no_baseline:
            baseline = launch_run(plan, model, work, "baseline", a.seed, chaos=False, relay=a.network)
            print(f"chaos: baseline (no kills) exited {baseline.exit_code} in {baseline.wall_s:.1f} s", flush=True)
        chaos = launch_run(plan, model, work, "chaos", a.seed, chaos=True, relay=a.network)
    return report(plan, chaos, baseline, a.json)


def report(plan: Plan, chaos: RunOutcome, baseline: RunOutcome | None, json_path: Path | None) -> int:
    """Print the figures (and write them to ``json_path``); 0 when every check passed."""
    checks = chaos.checks
    overhead = chaos.wall_s / baseline.wall_s - 1 if baseline and baseline.exit_code == 0 else None
    generator_kills = [k for k in chaos.kills if k.role.startswith("generator")]
    back = sorted(k.back_s for k in generator_kills if k.back_s is not None)
    planned_starts = 1 + sum(k.role == "trainer" for k in chaos.kills)  # the launch, and each planned kill
    ok = (chaos.exit_code == 0 and checks is not None and checks.ok and checks.max_staleness <= plan.max_staleness
          and checks.trainer_starts == planned_starts)
    fault_kinds = Counter(f.kind for f in chaos.faults)
    result = {
        "ok": ok, "plan": plan.__dict__, "exit_code": chaos.exit_code, "wall_s": round(chaos.wall_s, 1),
        "baseline_wall_s": round(baseline.wall_s, 1) if baseline else None,
        "baseline_exit_code": baseline.exit_code if baseline else None,
        "overhead": round(overhead, 3) if overhead is not None else None,
        "kills": [k.__dict__ for k in chaos.kills], "generator_kills": len(generator_kills),
        "faults": [f.__dict__ for f in chaos.faults], "fault_kinds": dict(fault_kinds),
        "planned_trainer_starts": planned_starts,
        "generator_back_s": {"median": back[len(back) // 2] if back else None, "max": back[-1] if back else None,
                             "back": len(back)},
        "fork_roles": plan.fork_roles,
        "restart_lines": chaos.restart_lines, "checks": checks.to_json() if checks else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_1m": os.getloadavg()[0]},
    }
    print(f"chaos: {len(generator_kills)} generator kills, {len(chaos.kills) - len(generator_kills)} other; "
          f"{chaos.restart_lines} restarts; exit {chaos.exit_code}")
    if chaos.faults:
        print(f"chaos: network faults {', '.join(f'{n} {kind}' for kind, n in sorted(fault_kinds.items()))}")
    if back:
        print(f"chaos: a killed generator was welcomed back after {back[len(back) // 2]:.1f} s (median; max "
              f"{back[-1]:.1f} s, back-off included; {len(back)} of {len(generator_kills)} came back before the end)")
    if checks is not None:
        print(f"chaos: {checks.groups_trained} groups in {checks.steps} steps; lost {len(checks.lost)}, "
              f"duplicated {len(checks.duplicated) + len(checks.duplicated_groups)}; {checks.resumes} resumes "
              f"(at most {checks.most_resumes} of one group), {sum(checks.dropped.values())} groups dropped "
              f"{f'{checks.dropped} ' if checks.dropped else ''}(their prompts served again), "
              f"{checks.resumes_checked} resumed samples checked, {len(checks.resume_mismatches)} mismatched; "
              f"max staleness {checks.max_staleness} (eta {plan.max_staleness}); "
              f"{checks.trainer_starts} trainer starts ({planned_starts} planned)")
    if overhead is not None:
        print(f"chaos: wall {chaos.wall_s:.1f} s vs {baseline.wall_s:.1f} s without kills or faults: overhead "  # type: ignore[union-attr]
              f"{100 * overhead:.1f}% (target < 25%)")
    print(f"chaos: {'PASS' if ok else 'FAIL'}")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
