"""Tree speculation against chain speculation and no speculation, with an online-trained EAGLE head.

One process, the default model. **Drafter**: ``--drafter DIR`` (a head saved by this script or by
``specroll drafter train``), or trained here online exactly as ``bench_drafter.py`` phase 1 trains it
(rounds of GSM8K training-prompt rollouts at T = 1 alternating with learner steps, budgeted by
``--train-minutes`` of learner time) and saved to ``--save-drafter DIR`` when given.

**Table**: the first ``--table-prompts`` GSM8K *test* prompts (specroll's chat template), one seed per
request, identical in every arm, at each temperature in ``--temperatures`` (no top-k/top-p) and live
batch B in ``--batch-sizes`` (``max_num_seqs = B``; ``--requests-per-slot`` · B requests queued,
so continuous batching keeps B slots busy until the queue drains), run as these arms, each on a fresh engine and
proposer:

- ``off``: no speculation;
- ``chain``: the head drafts k = ``--num-draft-tokens`` tokens sampled from q every step, verified
  by chain rejection sampling (``draft_length = "fixed"``);
- ``tree:SHAPE`` for each of ``--shapes``: the head's EAGLE-2 tree of that shape every step, verified
  by the tree walk (``draft_length = "tree"``);
- ``auto``: the engine's bandit over chains of k in [0, K] and the ``--shapes`` trees
  (``draft_length = "adaptive"``), what a generator runs by default with a drafter.

The arms run interleaved: ``--rounds`` rounds, each running every arm once in a rotated order, so a
slow stretch of a shared machine hits every arm alike. Reported per (T, B, arm): emitted tokens/s at
live batch B (the steps in which all B slots emitted; ``bench_speculative.py``), pooled over rounds;
its ratio to ``off``; acceptance length (``1 + accepted / draft steps``); and the cost split per
engine step: milliseconds proposing and verifying (target forward + verification), and for tree
arms the proposing split into the head's catch-up pass, its per-depth passes, the draft logits and
their processing (q), and choosing the nodes (``EagleProposer.tree_seconds``).

The issue's targets are printed beside the figures, not asserted: acceptance length >= 2.5 at T = 1,
B = 1 with at most 16 tree nodes; >= 1.6x over off at B = 1, T = 1; ``auto`` never below 0.97x off.

Usage (training ~15 min wall for 10 learner minutes, then ~15-25 min of table on 2 cores)::

    python benchmarks/bench_tree.py --save-drafter /tmp/tree_drafter --json bench_tree.json
    python benchmarks/bench_tree.py --drafter /tmp/tree_drafter --json bench_tree.json

and a smoke run::

    python benchmarks/bench_tree.py --quick --json /tmp/bench_tree.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from bench_drafter import DEFAULT_TRAIN_PROMPTS
from common import DEFAULT_PROMPTS, int_list
from spec_timing import Request, RunStats, pool_runs, timed_run

TARGETS = {"acceptance_length_t1_b1": 2.5, "speedup_t1_b1": 1.6, "auto_floor": 0.97}
QUICK = dict(train_minutes=0.3, round_size=4, rollout_max_tokens=48, steps_per_version=5, table_prompts=4,
             requests_per_slot=2,
             max_tokens=24, batch_sizes=[1, 2], temperatures=[1.0], rounds=1, shapes=["3x2:6"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--quick", action="store_true", help="a smoke run of every phase (about 2 minutes)")
    p.add_argument("--model", default="smollm2-135m", help="target model (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", type=Path, default=None, help="a saved drafter directory: skip training")
    p.add_argument("--save-drafter", type=Path, default=None, help="save the trained drafter here")
    p.add_argument("--train-prompts", type=Path, default=DEFAULT_TRAIN_PROMPTS)
    p.add_argument("--test-prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--train-minutes", type=float, default=10.0, help="learner minutes (default: %(default)s)")
    p.add_argument("--round-size", type=int, default=16)
    p.add_argument("--rollout-max-tokens", type=int, default=256)
    p.add_argument("--steps-per-version", type=int, default=50)
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--num-draft-tokens", type=int, default=4, help="chain length K (default: %(default)s)")
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["2x4:6", "4x4:12"],
                   help="tree shapes DEPTHxWIDTH:NODES, comma-separated (default: 2x4:6,4x4:12)")
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.7])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16])
    p.add_argument("--table-prompts", type=int, default=16, help="test prompts (default: %(default)s)")
    p.add_argument("--requests-per-slot", type=int, default=4,
                   help="requests queued per slot of the live batch: R·B, prompts repeating with their own seeds "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--arms", type=lambda s: s.split(","), default=None,
                   help="arms besides off, comma-separated among chain, tree, auto (default: all)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every arm (default: %(default)s)")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    from specroll.engine.spec.tree import TreeShape

    try:
        for shape in args.shapes:
            TreeShape.parse(shape)
    except ValueError as exc:
        p.error(f"--shapes: {exc}")
    if args.drafter is not None and not (args.drafter / "config.json").is_file():
        p.error(f"--drafter {args.drafter}: no drafter there (expected config.json and model.safetensors)")
    return args


def load_questions(path: Path, limit: int | None = None) -> list[str]:
    from specroll.rl.tasks import load_prompts

    return [q.question for q in load_prompts(path, limit=limit)]


def train_head(args: argparse.Namespace, checkpoint, train_prompts: list[list[int]]):
    """bench_drafter.py phase 1: online training on rollouts; returns the last version's head."""
    from drafter_online import OnlineDrafter, head_from_snapshot, run_online

    from specroll.drafter.learner import DrafterLearner, LearnerConfig
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.engine.model import CausalLM

    target = CausalLM(checkpoint.config)
    target.load_weights(checkpoint.weights)
    eos = sorted(set(checkpoint.tokenizer.eos_token_ids) | set(checkpoint.config.eos_token_ids))
    learner = DrafterLearner(target, LearnerConfig(min_rollouts=args.round_size, draft_vocab_size=args.draft_vocab_size,
                                                   seed=args.seed), eos_token_ids=eos)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.round_size, seed=args.seed,
                                 num_threads=args.threads, num_draft_tokens=args.num_draft_tokens),
                    checkpoint=checkpoint)
    online = OnlineDrafter(engine, learner, train_prompts, args.round_size, args.rollout_max_tokens, args.seed)
    versions = run_online(online, args.train_minutes * 60, args.steps_per_version)
    assert online.served is not None, "the budget allows at least one learner step"
    print(f"trained: {online.learner_seconds / 60:.2f} learner minutes, {learner.steps} steps, acceptance per "
          "version (chain k={}): {}".format(args.num_draft_tokens, ", ".join(
              f"{v.round.acceptance_length:.2f}" for v in versions if v.round and v.round.acceptance_length)),
          flush=True)
    del engine, learner, target
    gc.collect()
    return head_from_snapshot(online.served)


def arms(args: argparse.Namespace) -> list[str]:
    every = ["off", "chain", *(f"tree:{s}" for s in args.shapes), "auto"]
    return [a for a in every if a == "off" or args.arms is None or a.split(":")[0] in args.arms]


def make_engine(args: argparse.Namespace, checkpoint, head, arm: str, batch_size: int):
    from specroll.drafter.eagle import EagleProposer
    from specroll.drafter.eagle_head import EagleHead
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine

    proposer = None
    if arm != "off":  # a fresh head and proposer per engine: attach casts the head in place
        fresh = EagleHead(head.config, head.draft_to_target)
        fresh.load_state_dict(head.state_dict())
        proposer = EagleProposer(fresh, sample_drafts=True, seed=args.seed)
    length = {"off": "fixed", "chain": "fixed", "auto": "adaptive"}.get(arm, "tree")
    shapes = (arm.removeprefix("tree:"),) if arm.startswith("tree:") else tuple(args.shapes)
    config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=batch_size, seed=args.seed,
                          num_threads=args.threads, num_draft_tokens=args.num_draft_tokens, draft_length=length,
                          draft_trees=shapes)
    return Engine(config, checkpoint=checkpoint, proposer=proposer)


def table(args: argparse.Namespace, checkpoint, head, prompts: list[list[int]]) -> list[dict[str, object]]:
    from specroll.protocol.sampling import SamplingParams

    warm = SamplingParams(temperature=1.0, max_tokens=8, seed=args.seed, ignore_eos=True)
    for arm in arms(args):  # torch's first-call costs, paid untimed
        timed_run(make_engine(args, checkpoint, head, arm, 2), [Request(f"w{i}", f"w{i}", prompts[0], warm)
                                                                 for i in range(2)], 2)
    rows = []
    for temperature in args.temperatures:
        for b in args.batch_sizes:
            count = args.requests_per_slot * b
            requests = [Request(f"t{i}", f"t{i}", prompts[i % len(prompts)],
                                SamplingParams(temperature=temperature, top_p=1.0, max_tokens=args.max_tokens,
                                               seed=args.seed * 1_000_003 + i)) for i in range(count)]
            runs: dict[str, list[RunStats]] = {arm: [] for arm in arms(args)}
            split: dict[str, list[dict[str, float]]] = {}
            order = arms(args)
            for r in range(args.rounds):
                for arm in order[r % len(order):] + order[: r % len(order)]:
                    engine = make_engine(args, checkpoint, head, arm, b)
                    runs[arm].append(timed_run(engine, requests, b)[1])
                    if engine.proposer is not None:  # the head's tree cost, ms per engine step
                        parts = engine.proposer.tree_seconds  # type: ignore[attr-defined]
                        steps = max(engine.spec_stats.num_steps, 1)
                        split.setdefault(arm, []).append({k: 1e3 * v / steps for k, v in parts.items()})
                    del engine
                    gc.collect()
            off = pool_runs(runs["off"]).steady_tok_s
            for arm in order:
                run = pool_runs(runs[arm])
                steps = max(run.num_steps, 1)
                row = {"temperature": temperature, "batch_size": b, "arm": arm, "tok_s": run.steady_tok_s,
                       "ratio": run.steady_tok_s / off if off else None, "acceptance_length": run.acceptance_length,
                       "draft_ms_per_step": 1e3 * run.draft_time_s / steps,
                       "verify_ms_per_step": 1e3 * run.verify_time_s / steps,
                       "ratios_per_round": [x.steady_tok_s / o.steady_tok_s
                                            for x, o in zip(runs[arm], runs["off"], strict=True) if o.steady_tok_s],
                       "k_steps": {str(k): v for k, v in run.k_steps.items()}, "load_average": run.load_average,
                       "tree_draft_ms_per_step": {k: sum(d[k] for d in split[arm]) / len(split[arm])
                                                  for k in split[arm][0]} if split.get(arm) else None}
                rows.append(row)
                print(f"T={temperature} B={b:>2} {arm:>12}: {row['tok_s']:7.1f} tok/s  {row['ratio']:.2f}x  "
                      f"acc {run.acceptance_length:.2f}  draft {row['draft_ms_per_step']:.1f} ms  "
                      f"verify {row['verify_ms_per_step']:.1f} ms per step  load {run.load_average:.1f}", flush=True)
                if row["tree_draft_ms_per_step"] and any(row["tree_draft_ms_per_step"].values()):
                    print("      tree drafting, ms per step: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in row["tree_draft_ms_per_step"].items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from common import setup_torch

    from specroll.drafter.eagle_head import EagleHead
    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.rl.tasks import format_question

    _, args.dtype, threads, load_before = setup_torch(args.threads, args.dtype)
    print(f"model {args.model}, dtype {args.dtype}, {threads} threads, torch {torch.__version__}", flush=True)
    checkpoint = load_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    test = [tokenizer.encode_chat(format_question(q)) for q in load_questions(args.test_prompts, args.table_prompts)]
    start = time.perf_counter()
    if args.drafter is not None:
        head = EagleHead.load(args.drafter)
    else:
        train = [tokenizer.encode_chat(format_question(q)) for q in load_questions(args.train_prompts)]
        head = train_head(args, checkpoint, train)
        if args.save_drafter is not None:
            head.save(args.save_drafter)
            print(f"drafter -> {args.save_drafter}")
    train_s = time.perf_counter() - start
    rows = table(args, checkpoint, head, test)
    at = {(r["temperature"], r["batch_size"], r["arm"]): r for r in rows}
    best_tree = max((r for r in rows if r["temperature"] == 1.0 and r["batch_size"] == 1
                     and str(r["arm"]).startswith("tree:")), key=lambda r: r["tok_s"], default=None)
    autos = [r["ratio"] for r in rows if r["arm"] == "auto" and r["ratio"] is not None]
    if best_tree is not None:
        print(f"T=1 B=1 best tree {best_tree['arm']}: acceptance length {best_tree['acceptance_length']:.2f} "
              f"(target >= {TARGETS['acceptance_length_t1_b1']}), {best_tree['ratio']:.2f}x off "
              f"(target >= {TARGETS['speedup_t1_b1']}x); chain {at[(1.0, 1, 'chain')]['ratio']:.2f}x, "
              f"acceptance {at[(1.0, 1, 'chain')]['acceptance_length']:.2f}")
    if autos:
        print(f"auto / off: min {min(autos):.2f}x over every (T, B) (target >= {TARGETS['auto_floor']}x)")
    load_after = os.getloadavg()[0]
    print(f"1-min load average {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")
    if args.json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        report = {"rows": rows, "targets": TARGETS, "config": config, "train_or_load_seconds": train_s,
                  "load_avg": [load_before, load_after], "threads": threads, "dtype": args.dtype}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
