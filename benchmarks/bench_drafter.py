"""Online EAGLE drafter training: acceptance per drafter version, the speed it buys, and its
recovery after a policy update.

One process, one checkpoint loaded once in float32 (the generation engines cast it to ``--dtype``;
the drafter learner's target and the fine-tuned policy stay float32). Prompts are GSM8K questions
put through specroll's chat template (``encode_chat(format_question(q))``); every rollout samples at
temperature 1.0 (no top-k/top-p filter), and every drafting step drafts ``--num-draft-tokens``
tokens sampled from the head (``EagleProposer(sample_drafts=True)``).

1. **Online training** (``train_minutes``, ``train_steps``, ``versions``). An :class:`Engine`
   decodes rounds of ``--round-size`` rollouts of training prompts (each prompt once, in file order)
   and a :class:`DrafterLearner` trains on them, alternating: *generate a round* with the current
   drafter version, measuring its acceptance online, and add the rollouts to the learner; then
   *train* ``--steps-per-version`` learner steps, snapshot a new version and load it into the
   engine's proposer. The learner cold-starts its head after the first round; until then the engine
   decodes without speculation (version 0). Training is budgeted by **learner wall time**: only the
   seconds inside ``learner.step()`` count (target features of new rollouts are computed there), up
   to ``--train-minutes``; generation is not counted. The last version is measured by one more round.
   Each entry of ``versions``: the drafter version that generated the round, its acceptance length
   (``1 + accepted / draft steps`` over the round: tokens emitted per sequence-step that verified a
   draft; ``null`` for version 0), the round's tokens and seconds, and the learner's mean metrics
   over the steps that made the version (``loss``, ``top1_0``: the head's argmax agrees with the
   target's on the first draft, ``kl_0``).
2. **Speed table** (``table``, ``acceptance_length``, ``speedup_batch1``, ``speedup_batch4``): the
   first ``--table-prompts`` GSM8K *test* prompts, ``--max-tokens`` tokens at most each, one seed per
   request, identical in every row, at batch B in ``--batch-sizes`` (``max_num_seqs=B``: B requests
   in flight) with speculation off, with the **untrained** head (``EagleHead.init`` with the trained
   head's config and draft vocabulary; an ``eagle3`` head's LM head starts as the target's rows, as
   ``init-drafter`` makes it — ``--architecture`` picks the learner's head), with the **trained**
   head (the last version) drafting k tokens every step, and with the trained head under the
   engine's **adaptive** draft length (``draft_length="adaptive"``: k in [0, K] picked each step
   from measured tokens/s, what a generator with ``draft_length = "adaptive"`` runs;
   ``speedups_adaptive``). Each row
   gets a fresh engine and proposer, timed from its first step to its last; one short untimed
   generation with each pays torch's first-call costs first. The figure is emitted
   tokens/s at live batch B (over the steps in which all B slots emitted, as in
   ``bench_speculative.py``; the whole-run rate is in the JSON). ``acceptance_length`` is the trained
   head's at batch 1; ``speedup_batchB`` = trained tok/s over off tok/s at batch B.
3. **Policy shift** (``shift``, ``recovery_versions``). The policy is fine-tuned for ``--sft-steps``
   AdamW steps (lr ``--sft-lr``, ``--sft-batch`` examples a step) on GSM8K reference solutions (the
   ``answer`` field of the last lines of the training file, with their ``<<a*b=c>>`` calculator
   annotations and ``#### N`` line, then EOS; loss on the solution tokens only), through the dense
   differentiable ``CausalLM.score``. The new weights go to the engine (``update_weights``, policy
   version 1) and to the learner (``set_policy``). The same ``--round-size`` prompts are generated
   with the last drafter before the update (``acceptance_before``) and after it
   (``acceptance_after``: the drop); then training continues version by version, each version
   measured on a fresh round (``curve``) whose rollouts join the buffer (the older rollouts stay
   until pushed out, their features and teachers recomputed under the new policy).
   ``recovery_versions`` is the number of new versions until acceptance is back to at least 90% of
   ``acceptance_before``; ``null`` when ``--recovery-versions-max`` versions do not get there.

The issue's targets are printed next to the figures, not asserted: acceptance length >= 2.5 after
<= 10 minutes of training, speedup >= 1.8x at batch 1, recovery within 2 drafter versions.

Timing is wall-clock and the machine may be shared: on 2 cores another busy process stalls every
op of a 2-thread torch, so the 1-minute load average before and after is printed and written.

Usage (the full run takes about 30-35 minutes on 2 idle CPU cores, 10 of them learner steps)::

    python benchmarks/bench_drafter.py --json bench_drafter.json

and a smoke run of every phase (about 3 minutes)::

    python benchmarks/bench_drafter.py --quick --json /tmp/bench_drafter.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from common import DEFAULT_PROMPTS, int_list
from drafter_online import TEMPERATURE, OnlineDrafter, Version, fmt_acceptance, head_from_snapshot, run_online
from drafter_shift import RECOVERY_FRACTION, Shift, reference_solutions, shift_and_recover
from spec_timing import Request, RunStats, timed_run

from specroll.actors.cli import positive_int as _positive_int
from specroll.rl.tasks import PromptFileError, format_question, load_prompts

if TYPE_CHECKING:
    import torch

    from specroll.drafter.learner import DrafterSnapshot
    from specroll.engine.engine import Engine
    from specroll.engine.loaders.checkpoint import Checkpoint

DEFAULT_TRAIN_PROMPTS = DEFAULT_PROMPTS.with_name("train.jsonl")
"""GSM8K training split next to the default test split."""
TARGETS = {"acceptance_length": 2.5, "speedup_batch1": 1.8, "recovery_versions": 2}
"""Issue targets: acceptance length at least, batch-1 speedup at least, recovery versions at most."""
WARMUP_TOKENS = 8
"""Response tokens of the untimed warm-up generations before the speed table."""
QUICK = {"train_minutes": 0.5, "round_size": 4, "steps_per_version": 5, "rollout_max_tokens": 64,
         "max_tokens": 32, "table_prompts": 4, "sft_steps": 3, "sft_batch": 2, "recovery_versions_max": 2}
"""``--quick``: defaults of a smoke run of every phase (flags given explicitly still win)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Online EAGLE drafter training on GSM8K rollouts: acceptance per drafter version, "
                    "tokens/s of the trained head against speculation off, and recovery after a policy update.",
    )
    p.add_argument("--json", type=Path, default=None, help="where to write the results as JSON (default: don't)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run of every phase in a few minutes: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--train-prompts", type=Path, default=DEFAULT_TRAIN_PROMPTS,
                   help="GSM8K-style JSONL with 'question' and 'answer': rollout prompts and fine-tuning "
                        "solutions (default: %(default)s)")
    p.add_argument("--test-prompts", type=Path, default=DEFAULT_PROMPTS,
                   help="GSM8K-style JSONL ('question' per line): the speed table's prompts (default: %(default)s)")
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, Hugging Face checkpoint directory or .gguf file (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the engines' weight and activation dtype; auto = the engine's default (default: %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--seed", type=int, default=0, help="engine, sampling and learner seed (default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=_positive_int, default=4,
                   help="k: draft tokens per drafting step (default: %(default)s)")
    g = p.add_argument_group("online training")
    g.add_argument("--train-minutes", type=float, default=10.0,
                   help="learner wall time budget, minutes inside learner.step() (default: %(default)s)")
    g.add_argument("--round-size", type=_positive_int, default=16,
                   help="rollouts per generation round, all in flight at once (default: %(default)s)")
    g.add_argument("--rollout-max-tokens", type=_positive_int, default=256,
                   help="response tokens at most per training rollout (default: %(default)s)")
    g.add_argument("--steps-per-version", type=_positive_int, default=50,
                   help="learner steps between drafter versions (default: %(default)s)")
    g.add_argument("--learner-batch", type=_positive_int, default=4,
                   help="windows per learner step (default: %(default)s)")
    g.add_argument("--learner-window", type=_positive_int, default=128,
                   help="tokens per learner window (default: %(default)s)")
    g.add_argument("--learner-lr", type=float, default=1e-3, help="learner AdamW lr (default: %(default)s)")
    g.add_argument("--ttt-steps", type=_positive_int, default=3,
                   help="unrolled draft steps of the learner's loss (default: %(default)s)")
    g.add_argument("--buffer-rollouts", type=_positive_int, default=128,
                   help="learner replay buffer, in rollouts (oldest dropped first) (default: %(default)s)")
    g.add_argument("--draft-vocab-size", type=_positive_int, default=4096,
                   help="draft vocabulary of the cold-started head (default: %(default)s)")
    g.add_argument("--architecture", choices=["eagle3", "eagle"], default="eagle3",
                   help="architecture of the cold-started head: eagle3 (EAGLE-3's midlayer and own LM head) or "
                        "eagle (fc then a decoder layer, the target's LM head) (default: %(default)s)")
    t = p.add_argument_group("speed table")
    t.add_argument("--table-prompts", type=_positive_int, default=8,
                   help="test prompts, one request each, of every row (default: %(default)s)")
    t.add_argument("--max-tokens", type=_positive_int, default=128,
                   help="response tokens at most per table request (default: %(default)s)")
    t.add_argument("--batch-sizes", type=int_list, default=[1, 4],
                   help="comma-separated batch sizes (max_num_seqs) of the table (default: 1,4)")
    s = p.add_argument_group("policy shift")
    s.add_argument("--sft-steps", type=_positive_int, default=20,
                   help="AdamW steps of the policy's fine-tuning on reference solutions (default: %(default)s)")
    s.add_argument("--sft-batch", type=_positive_int, default=4, help="solutions per step (default: %(default)s)")
    s.add_argument("--sft-lr", type=float, default=3e-4, help="fine-tuning AdamW lr (default: %(default)s)")
    s.add_argument("--recovery-versions-max", type=_positive_int, default=6,
                   help="new drafter versions at most after the update (default: %(default)s)")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if not args.train_minutes > 0 or not args.learner_lr > 0 or not args.sft_lr > 0:
        p.error("--train-minutes, --learner-lr and --sft-lr must be positive")
    if not {1, 4} <= set(args.batch_sizes):
        p.error(f"--batch-sizes {args.batch_sizes}: expected 1 and 4 among them (speedup_batch1, speedup_batch4)")
    try:
        args.questions = [q.question for q in load_prompts(args.train_prompts)]
        args.test_questions = [q.question for q in load_prompts(args.test_prompts, limit=args.table_prompts)]
        args.solutions = reference_solutions(args.train_prompts, args.sft_steps * args.sft_batch)
    except PromptFileError as exc:
        p.error(f"{exc} (pass GSM8K JSONL files with --train-prompts / --test-prompts)")
    if args.table_prompts < max(args.batch_sizes):
        p.error(f"--table-prompts {args.table_prompts} is below the largest batch size {max(args.batch_sizes)}: "
                "the batch would never be full")
    if len(args.test_questions) < args.table_prompts:
        p.error(f"{args.test_prompts} holds {len(args.test_questions)} prompts, --table-prompts needs "
                f"{args.table_prompts}")
    return args


Drafter = Literal["off", "untrained", "trained", "adaptive"]
"""A row of the speed table: speculation off, the untrained head, the trained head (k = K every step),
the trained head with the engine's adaptive draft length (k in [0, K] each step)."""
DRAFTERS: tuple[Drafter, ...] = ("off", "untrained", "trained", "adaptive")


# ---- speed table -----------------------------------------------------------------------------


@dataclass
class Row:
    drafter: Drafter
    batch_size: int
    run: RunStats

    def as_json(self) -> dict[str, object]:
        return {"drafter": self.drafter, "batch_size": self.batch_size, "tok_s": self.run.steady_tok_s,
                "wall_tok_s": self.run.tok_s, "acceptance_length": self.run.acceptance_length,
                "run": self.run.as_json()}


def speed_table(checkpoint: Checkpoint, args: argparse.Namespace, prompts: list[list[int]],
                trained: DrafterSnapshot) -> list[Row]:
    """Phase 2 (module docstring): the same requests with speculation off, the untrained and the trained head."""
    from specroll.drafter.eagle import EagleProposer
    from specroll.drafter.eagle_head import EagleHead
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.protocol.sampling import SamplingParams

    trained_head = head_from_snapshot(trained)
    lm_head = None  # an eagle3 head starts from the target's LM-head rows, as init-drafter makes one
    if trained_head.config.architecture == "eagle3":
        name = "model.embed_tokens.weight" if checkpoint.config.tie_word_embeddings else "lm_head.weight"
        lm_head = checkpoint.weights[name].float()[trained_head.draft_to_target]
    untrained = EagleHead.init(trained_head.config, trained_head.draft_to_target, seed=args.seed, lm_head=lm_head)
    heads: dict[Drafter, dict[str, torch.Tensor] | None] = {
        "off": None, "untrained": untrained.state_dict(), "trained": trained_head.state_dict(),
        "adaptive": trained_head.state_dict()}

    def make_engine(batch_size: int, drafter: Drafter) -> Engine:
        proposer = None
        state = heads[drafter]
        if state is not None:  # a fresh head and proposer per engine: attach casts the head in place
            head = EagleHead(trained_head.config, trained_head.draft_to_target)
            head.load_state_dict(state)
            proposer = EagleProposer(head, sample_drafts=True, seed=args.seed)
        config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=batch_size, seed=args.seed,
                              num_threads=args.threads, num_draft_tokens=args.num_draft_tokens,
                              draft_length="adaptive" if drafter == "adaptive" else "fixed")
        return Engine(config, checkpoint=checkpoint, proposer=proposer)

    warm = SamplingParams(temperature=TEMPERATURE, max_tokens=WARMUP_TOKENS, seed=args.seed, ignore_eos=True)
    for drafter in DRAFTERS:
        timed_run(make_engine(2, drafter), [Request(f"w{i}", f"w{i}", prompts[0], warm) for i in range(2)], 2)
    requests = [Request(f"t{i}", f"t{i}", prompt,
                        SamplingParams(temperature=TEMPERATURE, top_p=1.0, max_tokens=args.max_tokens,
                                       seed=args.seed * 1_000_003 + i))
                for i, prompt in enumerate(prompts)]
    rows = []
    for batch_size in args.batch_sizes:
        for drafter in DRAFTERS:
            engine = make_engine(batch_size, drafter)
            _, run = timed_run(engine, requests, batch_size)
            del engine
            gc.collect()
            rows.append(Row(drafter, batch_size, run))
            print(f"  B={batch_size} {drafter:>9}: {run.tokens} tokens in {run.seconds:.1f} s = "
                  f"{run.steady_tok_s:.1f} tok/s at live batch {batch_size} ({run.tok_s:.1f} whole run), "
                  f"acceptance length {run.acceptance_length:.2f}, load {run.load_average:.1f}", flush=True)
    return rows


# ---- results ---------------------------------------------------------------------------------


@dataclass
class Results:
    versions: list[Version]
    train_seconds: float
    """Learner seconds of the online phase."""
    train_steps: int
    online_wall_seconds: float
    """The online phase's wall time, generation included."""
    rows: list[Row]
    shift: Shift

    def run(self, drafter: Drafter, batch_size: int) -> RunStats:
        return next(r.run for r in self.rows if r.drafter == drafter and r.batch_size == batch_size)

    def speedup(self, batch_size: int, drafter: Drafter = "trained") -> float:
        """A row's tokens/s at live batch B over speculation off's (the trained head's by default)."""
        return self.run(drafter, batch_size).steady_tok_s / self.run("off", batch_size).steady_tok_s

    def print_summary(self, args: argparse.Namespace) -> None:
        measured = [v.round.acceptance_length for v in self.versions if v.round and v.round.acceptance_length]
        print(f"online training: {self.train_seconds / 60:.2f} learner minutes, {self.train_steps} steps, "
              f"{len(self.versions) - 1} versions, {self.online_wall_seconds / 60:.1f} min wall with generation; "
              "acceptance per version: " + ", ".join(f"{a:.2f}" for a in measured))
        print(f"tokens/s at live batch B, T={TEMPERATURE}, k={args.num_draft_tokens} (adaptive: k in [0, "
              f"{args.num_draft_tokens}]), {args.table_prompts} test prompts, max_tokens {args.max_tokens}; "
              "ratio to off, acceptance length")
        print(f"{'B':>3} | {'off tok/s':>9} | " + " | ".join(f"{d:>9} tok/s  ratio  acc" for d in DRAFTERS[1:]))
        for b in args.batch_sizes:
            off = self.run("off", b)
            cells = [f"{self.run(d, b).steady_tok_s:>15.1f} {self.speedup(b, d):>5.2f}x "
                     f"{self.run(d, b).acceptance_length:>4.2f}" for d in DRAFTERS[1:]]
            print(f"{b:>3} | {off.steady_tok_s:>9.1f} | " + " | ".join(cells))
        print(f"acceptance_length {self.run('trained', 1).acceptance_length:.2f} "
              f"(target >= {TARGETS['acceptance_length']} after <= 10 min)")
        print(f"speedup_batch1 {self.speedup(1):.2f}x (target >= {TARGETS['speedup_batch1']}x), "
              f"speedup_batch4 {self.speedup(4):.2f}x; adaptive draft length: {self.speedup(1, 'adaptive'):.2f}x, "
              f"{self.speedup(4, 'adaptive'):.2f}x")
        shift = self.shift
        curve = ", ".join(fmt_acceptance(v.round.acceptance_length) for v in shift.curve if v.round)
        before, after = (fmt_acceptance(r.acceptance_length) for r in (shift.before, shift.after))
        print(f"policy shift (fine-tuning loss {shift.sft_losses[0]:.3f} -> {shift.sft_losses[-1]:.3f}): acceptance "
              f"{before} before, {after} after; new versions: {curve}")
        print(f"recovery_versions {shift.recovery_versions} (to >= {RECOVERY_FRACTION:.0%} of before; "
              f"target <= {TARGETS['recovery_versions']}; null: not within {args.recovery_versions_max})")

    def as_json(self) -> dict[str, object]:
        return {
            "acceptance_length": self.run("trained", 1).acceptance_length, "speedup_batch1": self.speedup(1),
            "speedup_batch4": self.speedup(4), "recovery_versions": self.shift.recovery_versions,
            "train_minutes": self.train_seconds / 60, "train_steps": self.train_steps,
            "online_wall_minutes": self.online_wall_seconds / 60, "versions": [v.as_json() for v in self.versions],
            "table": [r.as_json() for r in self.rows],
            "speedups": {str(r.batch_size): self.speedup(r.batch_size) for r in self.rows if r.drafter == "off"},
            "speedups_adaptive": {str(r.batch_size): self.speedup(r.batch_size, "adaptive") for r in self.rows
                                  if r.drafter == "off"},
            "shift": self.shift.as_json(),
        }


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch
    from common import setup_torch

    from specroll.drafter.learner import DrafterLearner, LearnerConfig
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.engine.model import CausalLM

    _, args.dtype, threads, load_before = setup_torch(args.threads, args.dtype)
    print(f"model {args.model}, dtype {args.dtype}, {threads} torch threads, torch {torch.__version__}, "
          f"T={TEMPERATURE}, k={args.num_draft_tokens}, learner budget {args.train_minutes} min, "
          f"{args.architecture} head", flush=True)

    # float32 once: the learner's target and the fine-tuning need it; each engine casts to its dtype.
    checkpoint = load_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    train_prompts = [tokenizer.encode_chat(format_question(q)) for q in args.questions]
    test_prompts = [tokenizer.encode_chat(format_question(q)) for q in args.test_questions]
    eos = sorted(set(tokenizer.eos_token_ids) | set(checkpoint.config.eos_token_ids))

    target = CausalLM(checkpoint.config)
    target.load_weights(checkpoint.weights)
    learner_config = LearnerConfig(
        lr=args.learner_lr, batch=args.learner_batch, window=args.learner_window, ttt_steps=args.ttt_steps,
        buffer_rollouts=args.buffer_rollouts, min_rollouts=args.round_size, draft_vocab_size=args.draft_vocab_size,
        seed=args.seed, architecture=args.architecture,
    )
    learner = DrafterLearner(target, learner_config, eos_token_ids=eos)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.round_size, seed=args.seed,
                                 num_threads=args.threads, num_draft_tokens=args.num_draft_tokens),
                    checkpoint=checkpoint)
    online = OnlineDrafter(engine, learner, train_prompts, args.round_size, args.rollout_max_tokens, args.seed)

    print(f"online training: rounds of {args.round_size} rollouts (<= {args.rollout_max_tokens} tokens), "
          f"{args.steps_per_version} learner steps per version", flush=True)
    wall = time.perf_counter()
    versions = run_online(online, args.train_minutes * 60, args.steps_per_version)
    online_wall = time.perf_counter() - wall
    train_s, train_steps = online.learner_seconds, learner.steps
    trained = online.served
    assert trained is not None, "the budget allows at least one learner step"

    print(f"speed table: {len(test_prompts)} test prompts, max_tokens {args.max_tokens}", flush=True)
    rows = speed_table(checkpoint, args, test_prompts, trained)

    print(f"policy shift: {args.sft_steps} fine-tuning steps of {args.sft_batch} reference solutions, "
          f"lr {args.sft_lr}", flush=True)
    shift = shift_and_recover(online, checkpoint, args)

    results = Results(versions, train_s, train_steps, online_wall, rows, shift)
    print()
    results.print_summary(args)
    load_after = os.getloadavg()[0]
    print(f"1-min load average {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
              if k not in ("questions", "test_questions", "solutions")}
    report = {**results.as_json(), "config": config, "load_avg": [load_before, load_after], "threads": threads,
              "dtype": args.dtype, "torch_version": torch.__version__, "targets": TARGETS}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
