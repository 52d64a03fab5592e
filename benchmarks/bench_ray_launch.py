"""What placement on Ray costs: the wall time of one whole ``specroll launch`` (start to exit) of a
short run on a tiny model, with the roles forked from the launcher (the default), as fresh
interpreters (``launch.fork_roles = false``) and as Ray actors' children (``--cluster ray``) — on a
Ray instance the launcher starts and stops, and on one already running (started here, as a cluster
would be) — alternated ``--repeats`` times; prints each and the ratios::

    python benchmarks/bench_ray_launch.py                 # 3 steps, 2 generators, 2 repeats
    python benchmarks/bench_ray_launch.py --steps 10 --repeats 3

The model is a 2-layer random-weight Llama written to a temporary directory (``tiny_model.py``).
Needs ``ray`` (``pip install 'specroll[ray]'``). Exit 1 when a launch fails.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiny_model import write_tiny_llama

MODES = {
    "forked (fork_roles = true)": ["--set", "launch.fork_roles=true"],
    "fresh interpreters (fork_roles = false)": ["--set", "launch.fork_roles=false"],
    "Ray actors, a Ray started by the launcher": ["--cluster", "ray"],
    "Ray actors, joining a running Ray": ["--cluster", "ray", "--set", "cluster.address={address}"],
}


def write_config(work: Path, model: Path, steps: int, generators: int) -> Path:
    """A short run on ``model``: one group of 2 per step, 8 tokens per sample; each generator reserves
    ``1 / generators`` Ray CPU, the trainer 1."""
    path = work / "run.toml"
    path.write_text(f"""steps = {steps}
[model]
name = "{model}"
[trainer]
batch_groups = 1
group_size = 2
max_groups_in_flight = 2
[generator]
count = {generators}
heartbeat_s = 0.5
[network]
heartbeat_timeout_s = 60.0
[generator.engine]
dtype = "float32"
kv_cache_memory_gb = 0.02
max_num_seqs = 8
[generator.sampling]
max_tokens = 8
[cluster.generator]
num_cpus = {1 / generators}
""")
    return path


def time_launch(config: Path, run_dir: Path, flags: list[str]) -> float:
    """Seconds from ``specroll launch`` starting to its exit (0, else SystemExit naming the failure)."""
    cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(config), "--set", f'run_dir="{run_dir}"', *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import ray

    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        work = Path(tmp)
        config = write_config(work, write_tiny_llama(work / "tiny"), args.steps, args.generators)
        address = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False).address_info["gcs_address"]
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        try:
            for repeat in range(args.repeats):
                for i, (mode, flags) in enumerate(MODES.items()):  # alternated: a busy moment hits every mode
                    flags = [flag.format(address=address) for flag in flags]
                    times[mode].append(time_launch(config, work / f"run-{repeat}-{i}", flags))
        finally:
            ray.shutdown()
    print(f"a whole launch, {args.steps} steps, {args.generators} generators, tiny model ({args.repeats} repeats):")
    base = statistics.median(times[next(iter(MODES))])
    for mode, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {mode:42s} median {median:5.1f} s  (runs: {', '.join(f'{s:.1f}' for s in seconds)})  "
              f"x{median / base:.2f} of forked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
