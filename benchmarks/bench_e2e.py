"""End to end: the same GRPO work trained three ways on this machine — TRL's GRPOTrainer, specroll in
synchronous mode and specroll's asynchronous pipeline — with trained samples/s and held-out accuracy.

Arms (run one after another, interleaved across seeds: for each seed, every arm):

- ``trl``: ``trl.GRPOTrainer`` on the CPU (``--trl-threads`` torch threads) on the same dequantized
  weights, prompts, reward and hyper-parameters (``e2e_trl.py``), generating with its training model
  (``transformers`` ``generate``); skipped, with the reason, when TRL is not installed
  (``pip install -e '.[bench]'``);
- ``sync``: ``specroll launch examples/gsm8k_smollm2.toml`` with ``trainer.mode="sync"``;
- ``specroll``: the same launch in the default asynchronous mode, with speculation and the online
  drafter as the example configures them (``e2e_specroll.py``).

Precision (``--precision``, the same for every arm; float32 parameters and AdamW state throughout):

- ``bf16`` (default): TRL ``GRPOConfig(bf16=True)`` — on the CPU accelerate wraps the model's forward in
  ``torch.autocast("cpu", dtype=torch.bfloat16)``, so TRL trains *and* generates under bf16 autocast;
  specroll ``trainer.precision="bf16"`` (autocast to bfloat16 in its training step) and
  ``generator.engine.dtype="bfloat16"``;
- ``fp32``: TRL ``bf16=False`` (trains and generates in float32); specroll ``trainer.precision="fp32"``
  and ``generator.engine.dtype="float32"`` (``auto`` would be bfloat16 on a CPU with native bf16).

Every arm's held-out evaluation runs on an engine of that dtype. Before ``--precision`` existed, TRL
ran at ``fp32`` while the specroll generators served bfloat16 (``auto``) to an fp32 trainer.

Common settings (``e2e_settings.py``): the model, the built-in arithmetic task, group size, prompts per
step, learning rate, max new tokens, temperature 1, evaluation every ``--eval-every`` steps on
``--eval-count`` held-out prompts. Their defaults are the example config's values, so the benchmark
trains what ``specroll launch`` on the example trains; every arm reads them from the one resolved run
config. GRPO as both sides run it: group std-normalised advantages, no KL term, one update per batch,
the token-level mean over the whole batch (TRL ``loss_type="dapo"``), AdamW (weight decay 0, default
betas) at a constant LR without warm-up, gradient norm clipped to 1. Every arm is evaluated by the same
code (``specroll.rl.evaluation``: one sample per prompt at the training sampling with a fixed seed per
prompt) — the specroll arms on their generators during the run, TRL's weights in a specroll engine.

Measured per arm and seed: reward per step, evaluation accuracy at each evaluated step, wall time of the
N steps from the arm's start (its first process started; TRL also without its evaluation time, which
is on its critical path, while specroll evaluates on its generators as training goes on), trained
samples/s = N x samples per step / wall time, and the time until the evaluation accuracy first reaches
``--target-accuracy``. Printed: a table, samples/s ratios specroll/trl, sync/trl and specroll/sync
(means over seeds; against TRL's wall time without evaluation), the final accuracy mean ± SE per arm and
the whole benchmark's duration. ``--json PATH`` writes everything, with the settings and versions.

    python benchmarks/bench_e2e.py --json e2e.json                          # 20 steps x 2 seeds x 3 arms
    python benchmarks/bench_e2e.py --quick --model TINY_CHECKPOINT_DIR --json out.json     # CI smoke run

Run it on an otherwise idle machine: every arm is timed on wall clock.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
from e2e_results import ArmResult, print_report, summarize
from e2e_settings import (
    ARMS,
    EXAMPLE,
    PRECISIONS,
    QUICK,
    Settings,
    check_comparable,
    example_defaults,
    resolved_config,
)
from e2e_specroll import run_specroll_arm
from e2e_trl import run_trl_arm, trl_unavailable

from specroll.actors.config import ConfigError
from specroll.actors.shared.files import write_text_atomic

PACKAGES = ("specroll", "torch", "transformers", "trl", "accelerate", "datasets")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the results here (atomically)")
    p.add_argument("--quick", action="store_true", help="CI smoke run on a tiny checkpoint (--model): 2 steps, "
                   "1 seed, 16 tokens, groups of 2 x 2 prompts, evaluation every step on 8 prompts")
    p.add_argument("--model", default=None, help="registered name, HF checkpoint dir or .gguf (default: smollm2-135m)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="run seeds (default: 0 1)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: 20)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="arms, in this order per seed")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (default: the example's)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the example's)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the example's)")
    p.add_argument("--max-tokens", type=int, default=None, help="max new tokens per sample (default: the example's)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default: the example's)")
    p.add_argument("--eval-count", type=int, default=None, help="held-out evaluation prompts (default: the example's)")
    p.add_argument("--target-accuracy", type=float, default=0.45, help="time the first evaluation at or above this")
    p.add_argument("--trl-threads", type=int, default=2, help="torch CPU threads of the TRL arm (default: 2)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="every arm's arithmetic (float32 parameters and AdamW state either way): bf16 (default) = "
                   "TRL bf16=True (CPU autocast, training and generation), specroll trainer.precision=bf16 and "
                   "bfloat16 generators; fp32 = all float32")
    p.add_argument("--arm-timeout-s", type=float, default=None,
                   help="longest one arm may run (default: 900 + 300 per step)")
    p.add_argument("--set", dest="extra_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="another override of the specroll arms' config (repeatable), e.g. "
                   "generator.engine.max_num_seqs=16 (not the precision's keys: use --precision)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the run directories and logs here (default: a "
                   "temporary directory, removed at the end)")
    args = p.parse_args(argv)
    if args.quick and args.model is None:
        p.error("--quick needs --model: a tiny checkpoint directory (the quick settings are sized for one)")
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        p.error(f"--workdir {args.workdir} is not empty (a run directory with a checkpoint would resume)")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    """Flags first, then ``--quick``'s values, then the example config's (and 20 steps, seeds 0 1)."""
    fallback: dict[str, object] = {**example_defaults(), "steps": 20, "seeds": [0, 1], **(QUICK if args.quick else {})}
    flags = {"group": args.group, "prompts": args.prompts, "learning_rate": args.lr, "max_tokens": args.max_tokens,
             "eval_every": args.eval_every, "eval_count": args.eval_count, "steps": args.steps, "seeds": args.seeds}
    chosen = {k: v if v is not None else fallback[k] for k, v in flags.items()}
    steps = int(chosen["steps"])  # type: ignore[call-overload]
    timeout = args.arm_timeout_s if args.arm_timeout_s is not None else 900.0 + 300.0 * steps
    return Settings(model=args.model or "smollm2-135m", arms=list(args.arms), target_accuracy=args.target_accuracy,
                    trl_threads=args.trl_threads, arm_timeout_s=timeout, quick=args.quick,
                    precision=args.precision, extra_sets=list(args.extra_sets), **chosen)  # type: ignore[arg-type]


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that matter (None: not installed), Python's and the machine."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return {**out, "python": platform.python_version(), "machine": platform.machine(), "cpus": str(os.cpu_count())}


def run_arm(s: Settings, seed: int, arm: str, workdir: Path) -> ArmResult:
    if arm == "trl":
        return run_trl_arm(s, seed, resolved_config(s, seed, workdir, "trl"), workdir)
    return run_specroll_arm(s, seed, arm, workdir)  # type: ignore[arg-type]


def document(s: Settings, results: list[ArmResult], started: float, complete: bool) -> dict[str, object]:
    """The ``--json`` document (also written after every arm, with ``complete: false``)."""
    first = s.seeds[0]
    configs = {arm: msgspec.to_builtins(resolved_config(s, first, Path("RUN_DIR"), arm))
               for arm in ("sync", "specroll")}
    summary = summarize(results, s.arms, s.target_accuracy) if complete else None
    return {"benchmark": "e2e", "complete": complete, "settings": s.to_json(), "example": str(EXAMPLE),
            "specroll_configs": configs, "versions": versions(), "load_average_1m": os.getloadavg()[0],
            "runs": [r.to_json(s.target_accuracy) for r in results], "summary": summary,
            "total_s": time.monotonic() - started}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:  # every config is validated before anything starts
        s = settings_from(args)
        for seed in s.seeds:
            for arm in ("sync", "specroll"):
                check_comparable(resolved_config(s, seed, Path("RUN_DIR"), arm), s.precision)
    except (ConfigError, ValueError) as exc:
        print(f"bench_e2e.py: {exc}", file=sys.stderr)
        return 2
    print(f"settings: {json.dumps(s.to_json())}")
    if "trl" in s.arms and (reason := trl_unavailable()):
        print(f"trl arm skipped: {reason}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    results: list[ArmResult] = []
    try:
        for seed in s.seeds:
            for arm in s.arms:
                print(f"[{time.monotonic() - started:7.1f} s] {arm}, seed {seed}", flush=True)
                r = run_arm(s, seed, arm, workdir / f"{arm}-seed{seed}")
                results.append(r)
                print(f"    {r.status}" + (f": {r.reason}" if r.reason else f", wall {r.wall_s:.1f} s, "
                      f"eval accuracy {r.eval_accuracy}"), flush=True)
                if args.json:
                    write_text_atomic(args.json, json.dumps(document(s, results, started, False), indent=1) + "\n")
    finally:
        if args.workdir is None and all(r.status != "failed" for r in results):
            shutil.rmtree(workdir, ignore_errors=True)
        elif args.workdir is None:
            print(f"run directories and logs kept in {workdir}")
    doc = document(s, results, started, True)
    print_report(results, doc["summary"], s.target_accuracy, s.precision)  # type: ignore[arg-type]
    print(f"the whole benchmark took {doc['total_s']:.1f} s")
    if args.json:
        write_text_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
