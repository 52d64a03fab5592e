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
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from common import int_list
from spec_timing import Request, RunStats, pool_runs, timed_run

from specroll.actors.cli import positive_int as _positive_int
from specroll.rl.tasks import PromptFileError, format_question, load_prompts

if TYPE_CHECKING:
    from specroll.engine.engine import Engine
    from specroll.engine.sequence import Completion
    from specroll.engine.spec.proposer import Proposer

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
"""GSM8K test split in the ``shared/`` folder next to the repository."""
MECHANISM_TARGET = 3.5
"""Issue target for ``mechanism_speedup``."""
AUTO_FLOOR = 0.95
"""Issue target: ``auto`` tokens/s over ``off`` tokens/s, at every batch size and temperature."""
WARMUP_TOKENS = 8
"""Response tokens of the untimed warm-up generations."""
MAX_REPLAY_ROUNDS = 3
"""Replay runs at most in the mechanism measurement (see :func:`measure_mechanism`)."""
NEAR_TIE_NATS = {"float32": 0.01, "float16": 0.1, "bfloat16": 0.5}
"""Per dtype, the largest gap between two runs' chosen-token logprobs at a greedy divergence still
counted as a rounding flip between near-equal top tokens (bfloat16 logits near 32 are 0.25 apart);
anything wider is a wrong distribution: an error."""

Mode = Literal["off", "suffix", "auto"]
MODES: tuple[Mode, ...] = ("off", "suffix", "auto")


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


# ---- the two measurements --------------------------------------------------------------------

EngineFactory = Callable[..., "Engine"]
"""``(max_num_seqs, proposer=None, draft_length="fixed") -> Engine`` sharing the loaded checkpoint."""


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class Divergence:
    """Where a replay run's greedy output departed from the rollout it replayed."""

    request_id: str
    round: int
    """Replay round (1: the rollouts are speculation-off's output)."""
    position: int
    """Index of the first differing response token."""
    rollout_token: int | None
    """``None`` when the rollout ended there (the replay ran on past its EOS or max_tokens)."""
    replay_token: int | None
    """``None`` when the replay ended there (it stopped early)."""
    rollout_logprob: float | None
    """log-softmax of ``rollout_token`` in the run that produced the rollout."""
    replay_logprob: float | None
    """log-softmax of ``replay_token`` in the replay run."""
    near_tie: bool
    """The two logprobs are within the dtype's :data:`NEAR_TIE_NATS`: both runs' top tokens were about
    equally likely, a rounding flip rather than a wrong distribution."""


@dataclass
class Mechanism:
    num_prompts: int
    off: RunStats
    replay: RunStats
    """The last replay round: the timed figure."""
    rounds: int
    divergences: list[Divergence]

    @property
    def speedup(self) -> float:
        return self.replay.tok_s / self.off.tok_s

    @property
    def all_drafts_correct(self) -> bool:
        """The last round emitted exactly the rollouts it replayed."""
        return not any(d.round == self.rounds for d in self.divergences)

    @property
    def ok(self) -> bool:
        """Every draft of the timed round was correct and no round departed by more than a near-tie."""
        return self.all_drafts_correct and all(d.near_tie for d in self.divergences)

    def as_json(self) -> dict[str, object]:
        return {"num_prompts": self.num_prompts, "off": self.off.as_json(), "replay": self.replay.as_json(),
                "speedup": self.speedup, "rounds": self.rounds, "all_drafts_correct": self.all_drafts_correct,
                "matches_greedy": not self.divergences, "ok": self.ok,
                "divergences": [asdict(d) for d in self.divergences]}


def _divergences(rollouts: Mapping[str, Completion], done: Mapping[str, Completion], round_: int,
                 tolerance: float) -> list[Divergence]:
    found = []
    for rid, expected in rollouts.items():
        a, b = expected.token_ids, done[rid].token_ids
        if a != b:
            at = _first_difference(a, b)
            token_a, lp_a = (a[at], expected.logprobs[at]) if at < len(a) else (None, None)
            token_b, lp_b = (b[at], done[rid].logprobs[at]) if at < len(b) else (None, None)
            # A length difference with a common prefix is no rounding flip: both stop at EOS or max_tokens.
            near_tie = lp_a is not None and lp_b is not None and abs(lp_a - lp_b) <= tolerance
            found.append(Divergence(rid, round_, at, token_a, token_b, lp_a, lp_b, near_tie))
    return found


def measure_mechanism(make_engine: EngineFactory, prompts: list[list[int]], max_tokens: int,
                      near_tie_nats: float) -> Mechanism:
    """Greedy batch-1 decoding against replaying its rollouts, every draft correct.

    A replay step scores 1 + k tokens in one forward and a plain step 1: in reduced precision the
    logits round differently, and where the top two tokens are within rounding of each other greedy
    picks can differ. Such a sequence then leaves its rollout and drafts nothing more, so the round is
    repeated, replaying its own output, until a round emits exactly what it replays (at most
    :data:`MAX_REPLAY_ROUNDS`); the last round is the timed figure.
    """
    from specroll.drafter.replay import ReplayProposer
    from specroll.protocol.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    requests = [Request(f"m{i}", f"m{i}", prompt, greedy) for i, prompt in enumerate(prompts)]

    engine = make_engine(1)
    expected, off = timed_run(engine, requests, 1)
    del engine
    gc.collect()
    divergences: list[Divergence] = []
    for round_ in range(1, MAX_REPLAY_ROUNDS + 1):
        proposer = ReplayProposer({r.group_id: r.prompt + expected[r.request_id].token_ids for r in requests})
        engine = make_engine(1, proposer=proposer)
        done, replay = timed_run(engine, requests, 1)
        del engine
        gc.collect()
        found = _divergences(expected, done, round_, near_tie_nats)
        divergences += found
        if not found:
            break
        expected = done
    return Mechanism(len(prompts), off, replay, round_, divergences)


def group_requests(prompts: list[list[int]], n: int, temperature: float, max_tokens: int, seed: int) -> list[Request]:
    """``n`` samples of each prompt, each with its own seed (as ``specroll generate`` seeds them)."""
    from specroll.protocol.sampling import SamplingParams

    requests = []
    for j, prompt in enumerate(prompts):
        for i in range(n):
            sampling = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens,
                                      seed=(seed * 1_000_003 + j) * 1_000_003 + i)
            requests.append(Request(f"g{j}#{i}", f"g{j}", prompt, sampling))
    return requests


@dataclass
class RolloutRow:
    temperature: float
    batch_size: int
    num_groups: int
    num_requests: int
    runs: dict[Mode, RunStats]

    def ratio(self, mode: Mode) -> float:
        """``mode``'s tokens/s at live batch B over speculation off's (the figure the targets apply to)."""
        return self.runs[mode].steady_tok_s / self.runs["off"].steady_tok_s

    def wall_ratio(self, mode: Mode) -> float:
        """``mode``'s tokens/s over the whole run, drain included, over speculation off's."""
        return self.runs[mode].tok_s / self.runs["off"].tok_s

    def as_json(self) -> dict[str, object]:
        return {"temperature": self.temperature, "batch_size": self.batch_size, "num_groups": self.num_groups,
                "num_requests": self.num_requests, **{mode: run.as_json() for mode, run in self.runs.items()},
                "suffix_ratio": self.ratio("suffix"), "auto_ratio": self.ratio("auto"),
                "suffix_wall_ratio": self.wall_ratio("suffix"), "auto_wall_ratio": self.wall_ratio("auto")}


def measure_rollouts(make_engine: EngineFactory, requests: list[Request], batch_size: int,
                     repeats: int = 1) -> dict[Mode, RunStats]:
    """The same requests with speculation off, suffix drafting at fixed k and adaptive k, ``repeats``
    times in rotating order (off, suffix, auto; suffix, auto, off; ...), so a slow spell of the
    machine does not land on one mode only; each mode's runs are pooled."""
    from specroll.drafter.suffix import SuffixProposer

    runs: dict[Mode, list[RunStats]] = {mode: [] for mode in MODES}
    for rep in range(repeats):
        for mode in MODES[rep % len(MODES):] + MODES[: rep % len(MODES)]:
            proposer: Proposer | None = None if mode == "off" else SuffixProposer()
            engine = make_engine(batch_size, proposer=proposer, draft_length="adaptive" if mode == "auto" else "fixed")
            _, r = timed_run(engine, requests, batch_size)
            runs[mode].append(r)
            del engine
            gc.collect()
            print(f"  {mode:>6}: {r.tokens} tokens in {r.seconds:.1f} s = {r.tok_s:.1f} tok/s "
                  f"({r.steady_tok_s:.1f} over {r.steady_steps} steps at live batch {batch_size}), "
                  f"acceptance length {r.acceptance_length:.2f}, mean live batch {r.mean_live_batch:.1f}, "
                  f"load {r.load_average:.1f}", flush=True)
    return {mode: pool_runs(mode_runs) for mode, mode_runs in runs.items()}


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
