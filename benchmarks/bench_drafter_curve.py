"""How good an EAGLE draft head gets for the default target at T = 1: acceptance against training budget.

One process, the default model (SmolLM2-135M-Instruct; the engines in ``--dtype``, bfloat16 on a
CPU with native bf16; the learner's target in float32, as ``bench_drafter.py`` keeps it).

1. **Data** (``curve_rollouts.py``): the target's own responses, sampled at T = 1 without top-k/top-p
   (as RL samples them), to the first ``--train-rollouts`` GSM8K *training* prompts and, held out,
   the first ``--eval-prompts`` *test* prompts, put through specroll's chat template
   (``encode_chat(format_question(q))``, as ``bench_drafter.py``); ``--rollout-max-tokens`` response
   tokens at most, ``--gen-batch`` in flight in one :class:`Engine`. Cached as JSONL under
   ``--cache-dir``, keyed by model, dtype, split, count, token cap, seed and prompts: a rerun
   generates nothing.
2. **Training** (``curve_training.py``): per ``--variants`` head, offline on the training rollouts
   with :class:`DrafterLearner` (cold start, AdamW, the training-time-test loss), to budgets of
   **CPU time** of the learner steps (``time.process_time()``: both threads, "CPU-minutes"),
   stopping at each of ``--checkpoints``; variants other than ``eagle3`` stop at
   ``--max-minutes-other``. The target's features of every rollout are computed once before any
   budget starts and shared (their cost is reported apart). Variants: ``eagle3`` (draft vocabulary
   ``--draft-vocab-size``, soft CE: specroll's default), ``eagle`` (EAGLE-1 style head),
   ``eagle3-fullvocab`` (the target's whole vocabulary), ``eagle3-tv`` (total-variation objective,
   ``LearnerConfig.objective = "tv"``), ``eagle3-kltv`` (``kl+tv``).
3. **Offline, at every checkpoint** (``curve_metrics.py``), on the held-out rollouts, teacher
   forced: per draft position 1..K, ``1 − TV(p, q)`` (a sampled draft's acceptance probability),
   KL(p̂ ‖ q) on the draft vocabulary and p's mass off it, top-1 agreement; the estimated acceptance
   length of a sampled chain of k = 1..K drafts, ``1 + Σ_{j≤k} Π_{i≤j} (1 − TV_i)`` (a teacher-forced
   estimate); and the target's own entropy.
4. **Engine, at each variant's last checkpoint** (and ``--engine-at``; ``curve_engine.py``):
   acceptance at T = 1, batch 1, on held-out prompts for chains k = 1..K, every ``--shapes`` tree
   and ``auto``; tokens/s of ``off``, the best chain, the best tree and ``auto`` at each
   ``--batch-sizes``, interleaved over ``--rounds`` rounds as ``bench_tree.py`` runs them, as
   ratios to ``off``. The offline chain estimate is printed beside the engine's chain acceptance.
5. **Output**: a table per variant and checkpoint, ``--json``, and ``--plot`` (PNG: estimated
   acceptance at k = K and ``1 − TV`` at position 1 against CPU-minutes, a line per variant).

Usage (on 2 idle cores: rollouts ~15 min for 1024 the first time, features ~1 CPU-minute per 80
rollouts, the training budgets at ~2 CPU-minutes per wall minute, ~1 min per offline measure, ~5-10
min of engine runs per variant; on a shared machine much longer — OMP_WAIT_POLICY=PASSIVE keeps
torch's two threads from spinning on each other when other processes hold the cores)::

    python benchmarks/bench_drafter_curve.py --threads 2 --json curve.json --plot curve.png

runs cut into parts (e.g. the main variant to 60 CPU-minutes, then the others to 10) are put in one
table and figure, each run's date, commit and command kept, without training anything::

    python benchmarks/bench_drafter_curve.py --report main.json others.json --json curve.json --plot curve.png

and a smoke run of every phase (about 3 minutes; the engine arms of the first variant only)::

    python benchmarks/bench_drafter_curve.py --quick --json /tmp/curve.json --plot /tmp/curve.png
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench_drafter import DEFAULT_TRAIN_PROMPTS
from common import DEFAULT_PROMPTS, int_list
from curve_engine import EngineBench
from curve_metrics import HeldOutBatch, offline_metrics
from curve_report import plot_curve, print_engine, print_table
from curve_training import MAIN_VARIANT, VARIANTS, BudgetedTraining

from specroll.actors.shared.arg_types import positive_int

if TYPE_CHECKING:
    from specroll.engine.loaders.checkpoint import Checkpoint
    from specroll.engine.model import CausalLM

DEFAULT_VARIANTS = ["eagle3", "eagle", "eagle3-fullvocab", "eagle3-tv"]
DEFAULT_SHAPES = ["2x4:6", "4x4:12", "2x4:6:sampled", "4x4:12:sampled"]
"""``bench_tree.py``'s shapes, top-k and sampled."""
DEFAULT_CACHE = Path.home() / ".cache" / "specroll" / "bench-drafter-curve"
QUICK = dict(train_rollouts=16, eval_prompts=4, rollout_max_tokens=48, gen_batch=16, checkpoints=[0.1, 0.25],
             max_minutes_other=0.25, engine_prompts=2, engine_max_tokens=24, batch_sizes=[1, 2], rounds=1,
             requests_per_slot=1, shapes=["3x2:6", "3x2:6:sampled"])
"""``--quick``: defaults of a smoke run of every phase (flags given explicitly still win)."""


def minutes_list(text: str) -> list[float]:
    """argparse type: comma-separated CPU-minutes, positive and increasing, such as ``2,5,10``."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated minutes such as 2,5,10") from None
    if not values or any(not v > 0 for v in values) or any(b <= a for a, b in itertools.pairwise(values)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive minutes in increasing order")
    return values


def name_list(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                   help="train nothing: print and --plot the variants of earlier runs' --json files together "
                        "(a variant in one file only), and write the merged results to --json")
    p.add_argument("--plot", type=Path, default=None, help="write the acceptance-against-budget figure here (PNG)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run of every phase in a few minutes: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--model", default="smollm2-135m", help="target model (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the engines' dtype (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="sampling, learner and engine seed (default: %(default)s)")
    d = p.add_argument_group("data")
    d.add_argument("--train-prompts", type=Path, default=DEFAULT_TRAIN_PROMPTS, help="GSM8K training JSONL")
    d.add_argument("--test-prompts", type=Path, default=DEFAULT_PROMPTS, help="GSM8K test JSONL (held out)")
    d.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="rollout cache (default: %(default)s)")
    d.add_argument("--train-rollouts", type=positive_int, default=1024, help="training rollouts (default: %(default)s)")
    d.add_argument("--eval-prompts", type=positive_int, default=64, help="held-out rollouts (default: %(default)s)")
    d.add_argument("--rollout-max-tokens", type=positive_int, default=256,
                   help="response tokens at most per rollout (default: %(default)s)")
    d.add_argument("--gen-batch", type=positive_int, default=64,
                   help="rollouts in flight while generating (default: %(default)s)")
    t = p.add_argument_group("training")
    t.add_argument("--variants", type=name_list, default=DEFAULT_VARIANTS,
                   help=f"comma-separated among {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})")
    t.add_argument("--checkpoints", type=minutes_list, default=[2, 5, 10, 20, 40, 60],
                   help="CPU-minutes of learner steps at which to measure (default: 2,5,10,20,40,60)")
    t.add_argument("--max-minutes-other", type=float, default=20.0,
                   help=f"last checkpoint of variants other than {MAIN_VARIANT} (default: %(default)s)")
    t.add_argument("--draft-vocab-size", type=positive_int, default=4096,
                   help="draft vocabulary of the top-N variants (default: %(default)s)")
    t.add_argument("--learner-batch", type=positive_int, default=4, help="windows per step (default: %(default)s)")
    t.add_argument("--learner-window", type=positive_int, default=128, help="tokens per window (default: %(default)s)")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    t.add_argument("--ttt-steps", type=positive_int, default=3,
                   help="unrolled draft steps of the training loss (default: %(default)s)")
    t.add_argument("--save-heads", type=Path, default=None, help="save each variant's last head in DIR/VARIANT")
    e = p.add_argument_group("measurement")
    e.add_argument("--num-draft-tokens", type=positive_int, default=4,
                   help="K: draft positions measured offline, longest chain in the engine (default: %(default)s)")
    e.add_argument("--engine-variants", type=name_list, default=None,
                   help="variants measured in the engine, or 'none' (default: every trained variant; "
                        "--quick: the first)")
    e.add_argument("--engine-at", type=minutes_list, default=[],
                   help="checkpoints (CPU-minutes) measured in the engine besides each variant's last")
    e.add_argument("--engine-prompts", type=positive_int, default=8,
                   help="held-out test prompts of the engine runs, one request each at B=1 (default: %(default)s)")
    e.add_argument("--engine-max-tokens", type=positive_int, default=128,
                   help="response tokens at most per engine request (default: %(default)s)")
    e.add_argument("--shapes", type=name_list, default=DEFAULT_SHAPES,
                   help=f"tree shapes DEPTHxWIDTH:NODES[:sampled] (default: {','.join(DEFAULT_SHAPES)})")
    e.add_argument("--batch-sizes", type=int_list, default=[1, 16],
                   help="batch sizes of the tokens/s comparison, 1 among them (default: 1,16)")
    e.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (default: %(default)s)")
    e.add_argument("--requests-per-slot", type=positive_int, default=2,
                   help="requests queued per slot at batch B: max(engine prompts, R·B) (default: %(default)s)")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.report is not None:
        check_report_args(p, args)
    else:
        check_args(p, args)
    return args


def check_report_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--report``: read every results file and refuse a variant that two of them hold (exit 2)."""
    from curve_report import merge_reports

    for path in (args.json, args.plot):
        if path is not None and not path.parent.is_dir():
            p.error(f"{path}: directory {path.parent} does not exist")
    reports = []
    for path in args.report:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            p.error(f"--report {path}: expected a results file written by --json ({exc})")
    try:
        args.merged = merge_reports(reports, [str(path) for path in args.report])
    except ValueError as exc:
        p.error(f"--report: {exc}")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad settings before anything loads (exit 2, naming the value)."""
    from specroll.engine.spec.tree import TreeShape
    from specroll.rl.tasks import PromptFileError, load_prompts

    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants or len(set(args.variants)) != len(args.variants):
        p.error(f"--variants {','.join(args.variants)}: unknown or repeated {unknown or args.variants}; "
                f"expected distinct names among {', '.join(VARIANTS)}")
    if args.engine_variants is None:  # a smoke run measures one head in the engine: the phase, not the figures
        args.engine_variants = args.variants[:1] if args.quick else list(args.variants)
    elif args.engine_variants == ["none"]:
        args.engine_variants = []
    elif not set(args.engine_variants) <= set(args.variants):
        p.error(f"--engine-variants {','.join(args.engine_variants)}: expected 'none' or names among --variants")
    if not args.max_minutes_other >= args.checkpoints[0]:
        p.error(f"--max-minutes-other {args.max_minutes_other}: expected at least the first checkpoint "
                f"({args.checkpoints[0]} CPU-minutes)")
    if not set(args.engine_at) <= set(args.checkpoints):
        p.error(f"--engine-at {args.engine_at}: expected checkpoints among --checkpoints {args.checkpoints}")
    if not args.lr > 0:
        p.error(f"--lr {args.lr}: expected a positive learning rate")
    if args.learner_window < args.ttt_steps + 2:
        p.error(f"--learner-window {args.learner_window}: expected at least --ttt-steps + 2 = {args.ttt_steps + 2}")
    if 1 not in args.batch_sizes:
        p.error(f"--batch-sizes {args.batch_sizes}: expected 1 among them (acceptance is measured at B=1)")
    try:
        for shape in args.shapes:
            TreeShape.parse(shape)
    except ValueError as exc:
        p.error(f"--shapes: {exc}")
    for path in (args.json, args.plot):
        if path is not None and not path.parent.is_dir():
            p.error(f"{path}: directory {path.parent} does not exist")
    try:
        args.train_questions = load_questions(load_prompts(args.train_prompts, limit=args.train_rollouts))
        args.test_questions = load_questions(load_prompts(args.test_prompts,
                                                          limit=max(args.eval_prompts, args.engine_prompts)))
    except PromptFileError as exc:
        p.error(f"{exc} (pass GSM8K JSONL files with --train-prompts / --test-prompts)")
    if len(args.train_questions) < args.train_rollouts:
        p.error(f"{args.train_prompts} holds {len(args.train_questions)} prompts, --train-rollouts needs "
                f"{args.train_rollouts}")
    if len(args.test_questions) < max(args.eval_prompts, args.engine_prompts):
        p.error(f"{args.test_prompts} holds {len(args.test_questions)} prompts, --eval-prompts/--engine-prompts "
                f"need {max(args.eval_prompts, args.engine_prompts)}")


def load_questions(prompts: list) -> list[str]:
    return [q.question for q in prompts]


def variant_checkpoints(args: argparse.Namespace, name: str) -> list[float]:
    """The checkpoints ``name`` trains to: all for the main variant, else up to ``--max-minutes-other``."""
    return [c for c in args.checkpoints if name == MAIN_VARIANT or c <= args.max_minutes_other]


def provenance(argv: list[str] | None) -> dict[str, object]:
    """Date, commit and command of this run (a figure carries them)."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str | None:
        proc = subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "src", "benchmarks")
    command = "python benchmarks/bench_drafter_curve.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return {"date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "commit": git("rev-parse", "--short", "HEAD"), "src_differs_from_commit": bool(dirty),
            "command": command.strip()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        k = args.merged["num_draft_tokens"]
        print_table(args.merged["variants"], k)
        print_engine(args.merged["variants"], k)
        args.num_draft_tokens = k
        write_outputs(args, args.merged, say=True)
        return 0
    import torch
    from common import setup_torch
    from curve_metrics import held_out_batches
    from curve_rollouts import Generation, load_or_generate
    from curve_training import learner_config, new_learner, shared_features

    from specroll.drafter.eagle_config import eagle3_feature_layers
    from specroll.drafter.learner import LearnerConfig
    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.engine.model import CausalLM
    from specroll.rl.tasks import format_question

    started = time.perf_counter()
    meta = provenance(argv)
    _, args.dtype, threads, load_before = setup_torch(args.threads, args.dtype)
    print(f"model {args.model}, engines in {args.dtype}, {threads} torch threads, torch {torch.__version__}; "
          f"variants {', '.join(args.variants)}; checkpoints {args.checkpoints} CPU-min (others to "
          f"{args.max_minutes_other}); commit {meta['commit']}", flush=True)
    checkpoint = load_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    eos = sorted(set(tokenizer.eos_token_ids) | set(checkpoint.config.eos_token_ids))
    train_prompts = [tokenizer.encode_chat(format_question(q)) for q in args.train_questions]
    test_prompts = [tokenizer.encode_chat(format_question(q)) for q in args.test_questions]

    gen = Generation(args.model, args.dtype, args.rollout_max_tokens, args.seed, args.gen_batch, args.threads)
    held_set = load_or_generate(args.cache_dir, checkpoint, gen, "test", test_prompts[: args.eval_prompts])
    train_set = load_or_generate(args.cache_dir, checkpoint, gen, "train", train_prompts)
    for s in (train_set, held_set):
        print(f"{s.split}: {len(s.rollouts)} rollouts, {s.response_tokens / len(s.rollouts):.0f} response tokens "
              f"on average, " + (f"generated in {s.generated_s:.0f} s" if s.generated_s else f"read from {s.path}"),
              flush=True)

    target = CausalLM(checkpoint.config)  # float32: the learner's target, as bench_drafter keeps it
    target.load_weights(checkpoint.weights)
    target.eval().requires_grad_(False)
    base = LearnerConfig(lr=args.lr, batch=args.learner_batch, window=args.learner_window, ttt_steps=args.ttt_steps,
                         draft_vocab_size=args.draft_vocab_size, max_context=1024, seed=args.seed)
    vocab = checkpoint.config.vocab_size
    configs = {name: learner_config(VARIANTS[name], base, vocab) for name in args.variants}
    wall = time.perf_counter()
    features, feature_cpu_s = shared_features(target, configs[args.variants[0]], train_set.rollouts, eos)
    print(f"target features of {len(features)} training rollouts: {feature_cpu_s / 60:.1f} CPU-min "
          f"({(time.perf_counter() - wall) / 60:.1f} min wall), outside every budget", flush=True)
    taps = eagle3_feature_layers(checkpoint.config.num_layers)  # every variant's (LearnerConfig.features)
    held = held_out_batches(target, held_set.rollouts, taps)
    engine_prompts = test_prompts[: args.engine_prompts]

    results: list[dict] = []
    report = {**meta, "variants": results, "data": {"train": train_set.as_json(), "held_out": held_set.as_json()},
              "feature_cpu_minutes": feature_cpu_s / 60, "config": {k: str(v) if isinstance(v, Path) else v
                                                                  for k, v in vars(args).items()
                                                                  if k not in ("train_questions", "test_questions")},
              "threads": threads, "torch_version": torch.__version__}
    for name in args.variants:
        train = BudgetedTraining(new_learner(target, configs[name], train_set.rollouts, eos, features))
        results.append(measure_variant(args, name, train, target, held, checkpoint, engine_prompts))
        write_outputs(args, {**report, "complete": False})  # what exists so far, should the run be cut short

    print()
    print_table(results, args.num_draft_tokens)
    print_engine(results, args.num_draft_tokens)
    load_after = os.getloadavg()[0]
    wall_min = (time.perf_counter() - started) / 60
    print(f"\n{wall_min:.1f} min wall in all; 1-min load average {load_before:.2f} before, {load_after:.2f} after "
          f"({os.cpu_count()} CPUs)")
    write_outputs(args, {**report, "complete": True, "wall_minutes": wall_min, "load_avg": [load_before, load_after]},
                  say=True)
    return 0


def measure_variant(args: argparse.Namespace, name: str, train: BudgetedTraining, target: CausalLM,
                    held: list[HeldOutBatch], checkpoint: Checkpoint, engine_prompts: list[list[int]]) -> dict:
    """Phases 2-4 for one variant: train to each checkpoint, measure offline there, then in the engine."""
    variant = VARIANTS[name]
    print(f"\n== {name}: {variant.about}", flush=True)
    points, heads = [], {}
    last = variant_checkpoints(args, name)[-1]
    for minutes in variant_checkpoints(args, name):
        mark = train.run_to(minutes)
        head = train.learner.head
        assert head is not None and tuple(head.config.feature_layers) == held[0].taps, "a step ran, on these taps"
        wall = time.perf_counter()
        offline = offline_metrics(head, target, held, args.num_draft_tokens)
        points.append({"checkpoint": minutes, **vars(mark), "offline": offline.as_json(),
                       "offline_eval_s": time.perf_counter() - wall, "engine": None})
        print(f"  {mark.cpu_minutes:6.2f} CPU-min ({mark.wall_minutes:.1f} wall), {mark.steps:5d} steps "
              f"({60 * mark.cpu_minutes / mark.steps:.2f} CPU-s each): est. acceptance k=1..{args.num_draft_tokens} "
              + " ".join(f"{a:.2f}" for a in offline.est_acceptance)
              + " | 1-TV " + " ".join(f"{x.accept_prob:.3f}" for x in offline.positions)
              + f" | train loss {mark.train.get('loss', float('nan')):.3f}", flush=True)
        if name in args.engine_variants and (minutes in args.engine_at or minutes == last):
            heads[len(points) - 1] = copy.deepcopy(head)
    head = train.learner.head
    assert head is not None
    if args.save_heads is not None:
        head.save(args.save_heads / name)
    entry = {"variant": name, "about": variant.about, "architecture": variant.architecture,
             "objective": variant.objective, "draft_vocab_size": head.config.draft_vocab_size, "points": points}
    del train, head
    gc.collect()
    for i, saved in heads.items():
        print(f"  engine, head at {points[i]['cpu_minutes']:.2f} CPU-min:", flush=True)
        wall = time.perf_counter()
        points[i]["engine"] = EngineBench(args, checkpoint, saved, engine_prompts).measure()
        points[i]["engine"]["wall_s"] = time.perf_counter() - wall
    return entry


def write_outputs(args: argparse.Namespace, report: dict, say: bool = False) -> None:
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        plot_curve(report, args.plot, args.num_draft_tokens)
    if say:
        print("".join(f"-> {path}\n" for path in (args.json, args.plot) if path is not None), end="")


if __name__ == "__main__":
    sys.exit(main())
