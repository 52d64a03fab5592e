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
   head's config and draft vocabulary) and with the **trained** head (the last version). Each row
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
import copy
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bench_speculative import DEFAULT_PROMPTS
from common import int_list
from spec_timing import Request, RunStats, timed_run

from specroll.actors.cli import positive_int as _positive_int
from specroll.actors.tasks import PromptFileError, format_question, load_prompts

if TYPE_CHECKING:
    import torch

    from specroll.drafter.eagle import EagleProposer
    from specroll.drafter.eagle_head import EagleHead
    from specroll.drafter.learner import DrafterLearner, DrafterSnapshot
    from specroll.engine.checkpoint import Checkpoint
    from specroll.engine.engine import Engine

DEFAULT_TRAIN_PROMPTS = DEFAULT_PROMPTS.with_name("train.jsonl")
"""GSM8K training split next to the default test split."""
TARGETS = {"acceptance_length": 2.5, "speedup_batch1": 1.8, "recovery_versions": 2}
"""Issue targets: acceptance length at least, batch-1 speedup at least, recovery versions at most."""
RECOVERY_FRACTION = 0.9
"""Acceptance counts as recovered at this fraction of its pre-update value."""
TEMPERATURE = 1.0
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


def reference_solutions(path: Path, count: int) -> list[tuple[str, str]]:
    """``(question, answer)`` of the last ``count`` lines of a GSM8K file, last first: the full
    reference solution, which :func:`load_prompts` cuts down to the final number.

    Raises:
        PromptFileError: a line is not JSON or lacks a non-empty string ``question`` or ``answer``.
    """
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    pairs = []
    for n, line in reversed(lines[-count:]):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        question, answer = (row.get(key) if isinstance(row, dict) else None for key in ("question", "answer"))
        if not (isinstance(question, str) and question and isinstance(answer, str) and answer):
            raise PromptFileError(f"{path}:{n}: expected non-empty string 'question' and 'answer' (a reference "
                                  "solution to fine-tune the policy on)")
        pairs.append((question, answer))
    return pairs


# ---- online training: rounds of rollouts, learner steps, drafter versions ---------------------


@dataclass
class Round:
    """One round of rollouts generated by one drafter version."""

    drafter_version: int
    policy_version: int
    rollouts: int
    tokens: int
    """Response tokens, EOS included."""
    seconds: float
    acceptance_length: float | None
    """``1 + accepted / draft steps`` over the round; ``None`` without any drafting step."""
    num_draft_steps: int
    num_accepted: int


Phase = Literal["train", "shift"]
"""Online training, or continued training after the policy update."""
Drafter = Literal["off", "untrained", "trained"]
"""A row of the speed table: speculation off, the untrained head, the trained head."""
DRAFTERS: tuple[Drafter, ...] = ("off", "untrained", "trained")


@dataclass
class Version:
    """A drafter version: how it was made and how it drafted."""

    version: int
    """0: no drafter yet (plain decoding)."""
    phase: Phase
    train_steps: int
    """Learner steps taken when it was published."""
    train_seconds: float
    """Learner seconds (this phase) when it was published."""
    metrics: dict[str, float]
    """The learner's metrics averaged over the steps since the previous version."""
    round: Round | None = None
    """The round generated with it (``None`` until measured)."""

    def as_json(self) -> dict[str, object]:
        return {"version": self.version, "phase": self.phase, "train_steps": self.train_steps,
                "train_seconds": self.train_seconds, "metrics": self.metrics,
                "acceptance_length": self.round.acceptance_length if self.round else None,
                "round": asdict(self.round) if self.round else None}


@dataclass
class OnlineDrafter:
    """The generation engine, the learner and the proposer that serves the learner's versions."""

    engine: Engine
    learner: DrafterLearner
    prompts: list[list[int]]
    """Training prompt token ids, taken in order, each once."""
    round_size: int
    max_tokens: int
    seed: int
    proposer: EagleProposer | None = None
    served: DrafterSnapshot | None = None
    """The version the proposer serves."""
    cursor: int = 0
    learner_seconds: float = 0.0
    """Seconds spent inside ``learner.step()`` so far."""
    _pending: list[dict[str, float]] = field(default_factory=list)

    def next_prompts(self) -> int:
        """Index of the first of ``round_size`` training prompts not used yet."""
        if self.cursor + self.round_size > len(self.prompts):
            raise RuntimeError(f"ran out of training prompts after {self.cursor}; pass a larger --train-prompts")
        self.cursor += self.round_size
        return self.cursor - self.round_size

    def generate(self, first: int, tag: str, feed: bool = True) -> Round:
        """One round of rollouts of the ``round_size`` training prompts from index ``first`` (seeded by
        their index) with the served drafter; fed to the learner unless not ``feed``."""
        from specroll.engine.driver import run_to_completion
        from specroll.protocol.sampling import SamplingParams

        for i in range(first, first + self.round_size):
            sampling = SamplingParams(temperature=TEMPERATURE, top_p=1.0, max_tokens=self.max_tokens,
                                      seed=self.seed * 1_000_003 + i)
            self.engine.add_request(self.prompts[i], sampling, f"{tag}#{i}")
        before = copy.copy(self.engine.spec_stats)
        start = time.perf_counter()
        done = run_to_completion(self.engine)
        seconds = time.perf_counter() - start
        after = self.engine.spec_stats
        steps, accepted = after.num_draft_steps - before.num_draft_steps, after.num_accepted - before.num_accepted
        policy = self.engine.weight_version
        if feed:
            for c in done.values():
                self.learner.add_rollout(c.prompt_token_ids + c.token_ids, len(c.prompt_token_ids), policy)
        return Round(self.learner.version, policy, len(done), sum(len(c.token_ids) for c in done.values()),
                     seconds, 1.0 + accepted / steps if steps else None, steps, accepted)

    def train(self, steps: int, deadline_s: float) -> int:
        """Up to ``steps`` learner steps, stopping once ``learner_seconds`` reaches ``deadline_s``."""
        taken = 0
        while taken < steps and self.learner_seconds < deadline_s:
            start = time.perf_counter()
            self._pending.append(self.learner.step())
            self.learner_seconds += time.perf_counter() - start
            taken += 1
        return taken

    def publish(self, phase: Phase, phase_start_s: float) -> Version:
        """Snapshot the learner as a new version and serve it."""
        from specroll.drafter.eagle import EagleProposer

        snap = self.served = self.learner.snapshot()
        head = head_from_snapshot(snap)
        if self.proposer is None:
            self.proposer = EagleProposer(head, sample_drafts=True, seed=self.seed)
            self.engine.set_proposer(self.proposer)
        else:
            self.proposer.load_head(head)
        keys = [k for k in self._pending[0] if k != "step"] if self._pending else []
        metrics = {k: sum(m[k] for m in self._pending) / len(self._pending) for k in keys}
        self._pending = []
        return Version(snap.version, phase, snap.train_steps, self.learner_seconds - phase_start_s, metrics)


def head_from_snapshot(snap: DrafterSnapshot) -> EagleHead:
    """The head a generator would build from a published version (a fresh copy each call)."""
    import msgspec

    from specroll.drafter.eagle_head import EagleConfig, EagleHead

    return EagleHead.from_tensors(msgspec.json.decode(snap.config_json, type=EagleConfig), snap.tensors)


def _fmt(acceptance: float | None) -> str:
    return f"{acceptance:.2f}" if acceptance is not None else "-"


def print_version(v: Version) -> None:
    r = v.round
    assert r is not None
    acc = _fmt(r.acceptance_length)
    learned = "".join(f" {k} {v.metrics[k]:.3f}" for k in ("loss", "top1_0", "kl_0") if k in v.metrics)
    print(f"  v{v.version:<3} {v.phase:>5} policy {r.policy_version}: acceptance {acc} over {r.num_draft_steps} "
          f"draft steps ({r.tokens} tokens in {r.seconds:.1f} s) | {v.train_steps} steps, "
          f"{v.train_seconds / 60:.2f} learner min{learned}", flush=True)


def run_online(online: OnlineDrafter, budget_s: float, steps_per_version: int) -> list[Version]:
    """Phase 1 (module docstring): rounds and versions until the learner has spent ``budget_s``."""
    versions = [Version(0, "train", 0, 0.0, {})]
    while True:
        versions[-1].round = online.generate(online.next_prompts(), f"r{len(versions)}")
        print_version(versions[-1])
        if online.learner_seconds >= budget_s:
            return versions
        if online.learner.ready and online.train(steps_per_version, budget_s):
            versions.append(online.publish("train", 0.0))


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
    untrained = EagleHead.init(trained_head.config, trained_head.draft_to_target, seed=args.seed)
    heads: dict[Drafter, dict[str, torch.Tensor] | None] = {
        "off": None, "untrained": untrained.state_dict(), "trained": trained_head.state_dict()}

    def make_engine(batch_size: int, drafter: Drafter) -> Engine:
        proposer = None
        state = heads[drafter]
        if state is not None:  # a fresh head and proposer per engine: attach casts the head in place
            head = EagleHead(trained_head.config, trained_head.draft_to_target)
            head.load_state_dict(state)
            proposer = EagleProposer(head, sample_drafts=True, seed=args.seed)
        config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=batch_size, seed=args.seed,
                              num_threads=args.threads, num_draft_tokens=args.num_draft_tokens)
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


# ---- policy shift ----------------------------------------------------------------------------


def fine_tune_policy(checkpoint: Checkpoint, examples: list[tuple[list[int], int]], steps: int, batch: int,
                     lr: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Supervised fine-tuning of a float32 copy of the policy on ``(token ids, prompt length)``
    examples: mean cross-entropy of the tokens after the prompt, AdamW, gradients clipped at 1.

    Returns:
        The new weights under Hugging Face names (copies), and the loss of each step.
    """
    import torch
    import torch.nn.functional as F

    from specroll.engine.model import CausalLM

    model = CausalLM(checkpoint.config)
    model.load_weights(checkpoint.weights)
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        part = [examples[(step * batch + i) % len(examples)] for i in range(batch)]
        width = max(len(ids) for ids, _ in part)
        ids = torch.zeros(batch, width, dtype=torch.long)  # [B, T]
        mask = torch.zeros(batch, width, dtype=torch.bool)  # [B, T]
        learn = torch.zeros(batch, width - 1, dtype=torch.bool)  # [B, T-1]: position t predicts a solution token
        for b, (row, prompt_len) in enumerate(part):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = True
            learn[b, prompt_len - 1 : len(row) - 1] = True
        logits = model.score(ids, mask)[:, :-1]  # [B, T-1, V]
        ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(learn)
        loss = (ce * learn).sum() / learn.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        print(f"  fine-tuning step {step + 1}/{steps}: loss {losses[-1]:.3f}", flush=True)
    return {name: t.clone() for name, t in model.hf_weights().items()}, losses


@dataclass
class Shift:
    sft_losses: list[float]
    sft_seconds: float
    before: Round
    """The last drafter on the old policy."""
    after: Round
    """The same drafter and prompts on the new policy: the drop."""
    curve: list[Version]
    """New versions trained on new-policy rollouts, each measured on a fresh round."""
    learner_seconds: float
    recovery_versions: int | None

    def as_json(self) -> dict[str, object]:
        before, after = self.before.acceptance_length, self.after.acceptance_length
        return {"acceptance_before": before, "acceptance_after": after,
                "threshold": RECOVERY_FRACTION * before if before is not None else None,
                "curve": [v.as_json() for v in self.curve],
                "recovery_versions": self.recovery_versions, "sft_losses": self.sft_losses,
                "sft_seconds": self.sft_seconds, "learner_seconds": self.learner_seconds,
                "before": asdict(self.before), "after": asdict(self.after)}


def shift_and_recover(online: OnlineDrafter, checkpoint: Checkpoint, args: argparse.Namespace) -> Shift:
    """Phase 3 (module docstring)."""
    first = online.next_prompts()
    before = online.generate(first, "before", feed=False)
    print(f"  last drafter v{online.learner.version} on policy 0: acceptance {_fmt(before.acceptance_length)}",
          flush=True)
    tokenizer = checkpoint.tokenizer
    examples = []
    for question, answer in args.solutions:
        prompt = tokenizer.encode_chat(format_question(question))
        examples.append((prompt + tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_ids[0]],
                         len(prompt)))
    start = time.perf_counter()
    weights, losses = fine_tune_policy(checkpoint, examples, args.sft_steps, args.sft_batch, args.sft_lr)
    sft_seconds = time.perf_counter() - start
    online.engine.update_weights(weights, 1)
    online.learner.set_policy(weights, 1)
    del weights
    gc.collect()
    after = online.generate(first, "after")
    print(f"  same drafter on policy 1: acceptance {_fmt(after.acceptance_length)}", flush=True)
    threshold = RECOVERY_FRACTION * (before.acceptance_length or 1.0)
    curve: list[Version] = []
    phase_start = online.learner_seconds
    recovered = None
    for i in range(1, args.recovery_versions_max + 1):
        online.train(args.steps_per_version, float("inf"))
        v = online.publish("shift", phase_start)
        v.round = online.generate(online.next_prompts(), f"s{i}")
        curve.append(v)
        print_version(v)
        if (v.round.acceptance_length or 1.0) >= threshold:
            recovered = i
            break
    return Shift(losses, sft_seconds, before, after, curve, online.learner_seconds - phase_start, recovered)


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

    def speedup(self, batch_size: int) -> float:
        """The trained head's tokens/s at live batch B over speculation off's."""
        return self.run("trained", batch_size).steady_tok_s / self.run("off", batch_size).steady_tok_s

    def print_summary(self, args: argparse.Namespace) -> None:
        measured = [v.round.acceptance_length for v in self.versions if v.round and v.round.acceptance_length]
        print(f"online training: {self.train_seconds / 60:.2f} learner minutes, {self.train_steps} steps, "
              f"{len(self.versions) - 1} versions, {self.online_wall_seconds / 60:.1f} min wall with generation; "
              "acceptance per version: " + ", ".join(f"{a:.2f}" for a in measured))
        print(f"tokens/s at live batch B, T={TEMPERATURE}, k={args.num_draft_tokens}, {args.table_prompts} test "
              f"prompts, max_tokens {args.max_tokens}; ratio to off")
        print(f"{'B':>3} | {'off tok/s':>9} | {'untrained tok/s':>15} {'ratio':>6} {'acc len':>7} | "
              f"{'trained tok/s':>13} {'ratio':>6} {'acc len':>7}")
        for b in args.batch_sizes:
            off, un, tr = self.run("off", b), self.run("untrained", b), self.run("trained", b)
            print(f"{b:>3} | {off.steady_tok_s:>9.1f} | {un.steady_tok_s:>15.1f} "
                  f"{un.steady_tok_s / off.steady_tok_s:>5.2f}x {un.acceptance_length:>7.2f} | "
                  f"{tr.steady_tok_s:>13.1f} {tr.steady_tok_s / off.steady_tok_s:>5.2f}x {tr.acceptance_length:>7.2f}")
        print(f"acceptance_length {self.run('trained', 1).acceptance_length:.2f} "
              f"(target >= {TARGETS['acceptance_length']} after <= 10 min)")
        print(f"speedup_batch1 {self.speedup(1):.2f}x (target >= {TARGETS['speedup_batch1']}x), "
              f"speedup_batch4 {self.speedup(4):.2f}x")
        shift = self.shift
        curve = ", ".join(_fmt(v.round.acceptance_length) for v in shift.curve if v.round)
        print(f"policy shift (fine-tuning loss {shift.sft_losses[0]:.3f} -> {shift.sft_losses[-1]:.3f}): acceptance "
              f"{_fmt(shift.before.acceptance_length)} before, {_fmt(shift.after.acceptance_length)} after; "
              f"new versions: {curve}")
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
            "shift": self.shift.as_json(),
        }


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch
    from common import setup_torch

    from specroll.drafter.learner import DrafterLearner, LearnerConfig
    from specroll.engine.checkpoint import load_checkpoint
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.engine.model import CausalLM

    _, args.dtype, threads, load_before = setup_torch(args.threads, args.dtype)
    print(f"model {args.model}, dtype {args.dtype}, {threads} torch threads, torch {torch.__version__}, "
          f"T={TEMPERATURE}, k={args.num_draft_tokens}, learner budget {args.train_minutes} min", flush=True)

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
        seed=args.seed,
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
