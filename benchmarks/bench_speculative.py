"""Speculative decoding throughput: emitted tokens/s with speculation on against speculation off.

Every figure compares runs of the same engine on the same requests in the same process: one
checkpoint, loaded once, one dtype, GSM8K prompts put through specroll's chat template
(``encode_chat(format_question(q))``). Each run gets a fresh engine (an empty prefix cache, a fresh
proposer and, for ``auto``, a fresh draft-length bandit), and is timed from the first engine step to
the last: prefill, proposing, verification and the bandit's exploration count; loading and engine
construction do not. The figure is **emitted tokens per second**: response tokens of every request
(up to and including EOS or ``--max-tokens``) over that wall time. One short untimed generation, with
and without drafts, pays torch's first-call costs first.

- **mechanism** (``mechanism_speedup``, target >= 3.5): batch 1 (``max_num_seqs=1``), greedy, the
  first ``--mechanism-prompts`` prompts queued one after another. Speculation off runs first and
  records each prompt's rollout; then a :class:`ReplayProposer` drafts ``--num-draft-tokens`` tokens
  (fixed k) from those rollouts, so every draft is correct and the speedup is what one-forward
  verification of k + 1 tokens allows, with proposing almost free. Greedy speculation must emit the
  same tokens as greedy decoding, up to rounding: in bfloat16 a forward over 1 + k rows rounds the
  logits differently from a one-row step, and where the top two tokens are within rounding of each
  other the greedy pick can flip. Such a sequence leaves its rollout and drafts nothing more, so the
  replay is repeated on its own output (at most 3 rounds) until every draft is correct; the last
  round is timed. Every departure is printed with both tokens' logprobs; the script exits with
  status 1 (after writing every figure) when one is not a near-tie (logprobs further apart than
  0.5 nats in bfloat16, 0.1 in float16, 0.01 in float32) or the last round still departs.
- **rollouts** (target: ``auto`` never below 0.95x off): RL-style group rollouts, ``--n`` samples
  per prompt with their own seeds, at each ``--temperatures`` T (no top-k/top-p filter) and live
  batch size B in ``--batch-sizes``, run three ways on identical requests: ``off``, ``suffix``
  (:class:`SuffixProposer`, fixed k = ``--num-draft-tokens``) and ``auto`` (the same proposer with
  ``draft_length="adaptive"``: the engine picks k in [0, K] each step and should pick 0 when
  drafting does not pay). The live batch is B through ``max_num_seqs=B``; unless ``--groups`` says
  otherwise, ceil(max(n, 4B) / n) groups are queued, so at least 4B requests wait for B slots and
  continuous batching keeps the batch at B until the queue drains (B=1: one group of n, decoded
  one after another, later samples drafting from their finished siblings; B=16: 8 groups of 8).
  Reported: tokens/s **at live batch B** — over the steps in which all B slots emitted — and its
  ratio to off (the figure the target applies to), the whole-run ratio beside it, acceptance
  length (tokens emitted per sequence-step that verified a draft: ``1 + accepted / draft steps``),
  for ``auto`` the fraction of emitting steps that ran with k = 0, and the mean live batch.

Sampled runs draw different tokens with and without speculation (the distribution is the same, the
random stream is not), so their responses differ in length, and so does the drain at the end of a
run, when fewer than B requests are left: a run whose last responses happen to be long spends
longer at a small batch. Tokens/s over the whole run mixes that luck in; the rate at live batch B
does not.

Timing is wall-clock and the machine may be shared: on a 2-core machine, another busy process
stalls a 2-thread torch at every op; ``--threads 1`` is far less sensitive. The 1-minute load
average before and after is printed and written with the results.

Usage (the full run takes about 10-15 minutes on 2 CPU cores)::

    python benchmarks/bench_speculative.py --json bench_speculative.json

and a smoke run::

    python benchmarks/bench_speculative.py --max-tokens 12 --mechanism-prompts 1 --n 2 \\
        --batch-sizes 1,2 --temperatures 1.0 --json /tmp/bench_speculative.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from common import DEFAULT_PROMPTS, int_list
from spec_mechanism import NEAR_TIE_NATS, measure_mechanism
from spec_rollouts import RolloutRow, group_requests, measure_rollouts
from spec_timing import Request, timed_run

from specroll.actors.cli import positive_int as _positive_int
from specroll.rl.tasks import PromptFileError, format_question, load_prompts

if TYPE_CHECKING:
    from specroll.engine.engine import Engine
    from specroll.engine.spec.proposer import Proposer

MECHANISM_TARGET = 3.5
"""Issue target for ``mechanism_speedup``."""
AUTO_FLOOR = 0.95
"""Issue target: ``auto`` tokens/s over ``off`` tokens/s, at every batch size and temperature."""
WARMUP_TOKENS = 8
"""Response tokens of the untimed warm-up generations."""


def _float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers such as 1.0,0.7") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected temperatures > 0 (sampled group rollouts)")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Emitted tokens/s of speculative decoding against speculation off: the mechanism's "
                    "upper bound (replayed greedy rollouts) and suffix / auto drafting on group rollouts.",
    )
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                   help="GSM8K-style JSONL file ('question' per line) (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="where to write the results as JSON (default: don't)")
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, Hugging Face checkpoint directory or .gguf file (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weight and activation dtype; auto = the engine's default (bfloat16 on CPUs with "
                        "native bf16, else float32) (default: %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: torch's own choice). With 2 threads on 2 cores, "
                        "any other busy process stalls every op at a thread barrier")
    p.add_argument("--max-tokens", type=_positive_int, default=128,
                   help="response tokens at most per request (default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=_positive_int, default=4,
                   help="K: draft tokens per step (fixed k for replay and suffix, the most for auto) "
                        "(default: %(default)s)")
    p.add_argument("--mechanism-prompts", type=_positive_int, default=4,
                   help="prompts of the replay (mechanism) measurement (default: %(default)s)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16],
                   help="comma-separated live batch sizes (max_num_seqs) of the rollout runs (default: 1,4,16)")
    p.add_argument("--temperatures", type=_float_list, default=[1.0, 0.7],
                   help="comma-separated sampling temperatures of the rollout runs (default: 1.0,0.7)")
    p.add_argument("--n", type=_positive_int, default=8, help="samples per prompt (group size) (default: %(default)s)")
    p.add_argument("--groups", type=int_list, default=None,
                   help="groups (prompts) per batch size: one number for all, or one per --batch-sizes entry "
                        "(default: ceil(max(n, 4B) / n), i.e. at least 4B requests for B slots)")
    p.add_argument("--seed", type=int, default=0, help="engine and sampling seed (default: %(default)s)")
    p.add_argument("--repeats", type=_positive_int, default=1,
                   help="runs of each rollout mode, in rotating order, pooled (default: %(default)s)")
    args = p.parse_args(argv)
    if args.groups is None:
        args.groups = [math.ceil(max(args.n, 4 * b) / args.n) for b in args.batch_sizes]
    elif len(args.groups) == 1:
        args.groups = args.groups * len(args.batch_sizes)
    if len(args.groups) != len(args.batch_sizes):
        p.error(f"--groups has {len(args.groups)} values and --batch-sizes {len(args.batch_sizes)}; "
                "give one number or one per batch size")
    needed = max(args.mechanism_prompts, *args.groups)
    try:
        args.questions = [q.question for q in load_prompts(args.prompts, limit=needed)]
    except PromptFileError as exc:
        p.error(f"{exc} (pass a GSM8K-style JSONL file with --prompts PATH)")
    if len(args.questions) < needed:
        p.error(f"{args.prompts} holds {len(args.questions)} prompts, the settings need {needed}")
    return args


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch
    from common import setup_torch

    from specroll.drafter.suffix import SuffixProposer
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.protocol.sampling import SamplingParams

    dtype, args.dtype, threads, load_before = setup_torch(args.threads, args.dtype)
    print(f"model {args.model}, dtype {args.dtype}, {threads} torch threads, torch {torch.__version__}, "
          f"max_tokens {args.max_tokens}, K {args.num_draft_tokens}", flush=True)

    checkpoint = load_checkpoint(args.model, dtype=dtype)
    prompts = [checkpoint.tokenizer.encode_chat(format_question(q)) for q in args.questions]

    def make_engine(max_num_seqs: int, proposer: Proposer | None = None,
                    draft_length: Literal["fixed", "adaptive"] = "fixed") -> Engine:
        config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max_num_seqs, seed=args.seed,
                              num_threads=args.threads, num_draft_tokens=args.num_draft_tokens,
                              draft_length=draft_length)
        return Engine(config, checkpoint=checkpoint, proposer=proposer)

    # Warm-up, untimed: torch's first-call costs for plain decode steps and for draft-verify steps.
    warm = SamplingParams(temperature=1.0, max_tokens=WARMUP_TOKENS, seed=args.seed, ignore_eos=True)
    for proposer in (None, SuffixProposer()):
        timed_run(make_engine(2, proposer=proposer), [Request(f"w{i}", "w", prompts[0], warm) for i in range(2)], 2)
    gc.collect()

    print(f"mechanism: {args.mechanism_prompts} prompts, batch 1, greedy, replayed rollouts", flush=True)
    mechanism = measure_mechanism(make_engine, prompts[: args.mechanism_prompts], args.max_tokens,
                                  NEAR_TIE_NATS[args.dtype])

    rows: list[RolloutRow] = []
    for temperature in args.temperatures:
        for batch_size, num_groups in zip(args.batch_sizes, args.groups, strict=True):
            requests = group_requests(prompts[:num_groups], args.n, temperature, args.max_tokens, args.seed)
            print(f"rollouts T={temperature} B={batch_size}: {num_groups} groups x n={args.n}", flush=True)
            runs = measure_rollouts(make_engine, requests, batch_size, args.repeats)
            rows.append(RolloutRow(temperature, batch_size, num_groups, len(requests), runs))

    print()
    print(f"mechanism (batch 1, T=0, replay k={args.num_draft_tokens}, {args.mechanism_prompts} prompts): "
          f"off {mechanism.off.tok_s:.1f} tok/s, replay {mechanism.replay.tok_s:.1f} tok/s = "
          f"{mechanism.speedup:.2f}x (target >= {MECHANISM_TARGET}), "
          f"acceptance length {mechanism.replay.acceptance_length:.2f}, replay round {mechanism.rounds}")
    def token(t: int | None, logprob: float | None) -> str:
        return "the end" if t is None or logprob is None else f"{t} (logprob {logprob:.3f})"

    for d in mechanism.divergences:
        kind = "near-tie rounding flip" if d.near_tie else "ERROR: not a near-tie"
        print(f"  replay round {d.round}: {d.request_id} departed from its rollout at response token {d.position}: "
              f"{token(d.replay_token, d.replay_logprob)} instead of {token(d.rollout_token, d.rollout_logprob)}: "
              f"{kind}")
    if not mechanism.all_drafts_correct:
        print(f"ERROR: replay round {mechanism.rounds} still departed from its rollouts: not every draft was correct")
    print()
    print("tokens/s at live batch B (steps with every slot emitting); ratio to off; [whole run, drain included]")
    print(f"{'T':>4} {'B':>3} {'reqs':>4} | {'off tok/s':>9} | {'suffix tok/s':>12} {'ratio':>6} {'[wall]':>7} "
          f"{'acc len':>7} | {'auto tok/s':>10} {'ratio':>6} {'[wall]':>7} {'acc len':>7} {'k=0':>5}")
    for row in rows:
        off, suffix, auto = row.runs["off"], row.runs["suffix"], row.runs["auto"]
        print(f"{row.temperature:>4} {row.batch_size:>3} {row.num_requests:>4} | {off.steady_tok_s:>9.1f} | "
              f"{suffix.steady_tok_s:>12.1f} {row.ratio('suffix'):>5.2f}x [{row.wall_ratio('suffix'):.2f}x] "
              f"{suffix.acceptance_length:>7.2f} | {auto.steady_tok_s:>10.1f} {row.ratio('auto'):>5.2f}x "
              f"[{row.wall_ratio('auto'):.2f}x] {auto.acceptance_length:>7.2f} {auto.k0_fraction:>5.0%}")
    auto_min = min(row.ratio("auto") for row in rows)
    print(f"auto: lowest ratio to off {auto_min:.2f}x (target >= {AUTO_FLOOR}); "
          "k=0: fraction of auto's emitting steps that drafted nothing")

    # Other processes on the machine skew runs, not necessarily alike; the load shows them.
    load_after = os.getloadavg()[0]
    print(f"1-min load average {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")

    report = {
        "model": args.model, "dtype": args.dtype, "threads": threads, "torch_version": torch.__version__,
        "max_tokens": args.max_tokens, "num_draft_tokens": args.num_draft_tokens, "n": args.n, "seed": args.seed,
        "prompts": str(args.prompts), "load_average": [load_before, load_after],
        "groups": args.groups, "mechanism_speedup": mechanism.speedup, "mechanism": mechanism.as_json(),
        "rollouts": [row.as_json() for row in rows], "auto_min_ratio": auto_min,
        "targets": {"mechanism_speedup": MECHANISM_TARGET, "auto_min_ratio": AUTO_FLOOR},
        "targets_met": {"mechanism_speedup": mechanism.speedup >= MECHANISM_TARGET,
                        "auto_min_ratio": auto_min >= AUTO_FLOOR},
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"-> {args.json}")
    return 0 if mechanism.ok else 1


if __name__ == "__main__":
    sys.exit(main())
