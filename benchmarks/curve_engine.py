"""``bench_drafter_curve.py``'s engine measurements of one trained head: acceptance in the engine at
T = 1 for every chain length, tree shape and ``auto``, and tokens/s against speculation off.

Arms (each on a fresh engine and proposer, ``bench_tree.make_engine``): ``off``; ``chain:k`` for
k = 1..K (k drafts sampled from the head every step, ``draft_length = "fixed"``,
``EagleProposer(sample_drafts=True)``); ``tree:SHAPE`` per shape (``draft_length = "tree"``);
``auto`` (``draft_length = "adaptive"`` over chains of k ≤ K and every shape).

1. **Batch 1, every arm**: one run of each arm, in order, on the same requests (the first
   ``--engine-prompts`` held-out prompts, one seed per request). Acceptance length is
   ``1 + accepted / draft steps`` (the engine's ``spec_stats``); ``accepted_per_pos[j] / draft steps``
   is the measured probability that draft j + 1 was accepted (a chain stops at its first rejection).
   The chain and the tree with the most tokens/s here are "the best".
2. **Tokens/s**: ``off``, the best chain, the best tree and ``auto`` at each batch size B, over
   ``--rounds`` rounds, each round running every arm once in an order rotated by the round number,
   exactly as ``bench_tree.py`` does (at B = 1 the first pass counts as round 0). B slots are kept busy by
   ``max(--engine-prompts, --requests-per-slot · B)`` requests; tokens/s is counted over the steps
   in which all B slots emitted (``spec_timing.timed_run``), pooled over rounds, with its ratio to ``off``.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench_tree import make_engine
from spec_timing import Request, RunStats, pool_runs, timed_run

if TYPE_CHECKING:
    from specroll.drafter.eagle_head import EagleHead
    from specroll.engine.loaders.checkpoint import Checkpoint

WARMUP_TOKENS = 8
"""Response tokens of each arm's untimed warm-up run (torch's first-call costs)."""


def arm_names(shapes: list[str], max_k: int) -> list[str]:
    return ["off", *(f"chain:{k}" for k in range(1, max_k + 1)), *(f"tree:{s}" for s in shapes), "auto"]


def arm_depth(arm: str, max_k: int) -> int:
    """The most drafts an arm's step can accept: k, the tree's depth, K for ``auto`` (0 for ``off``)."""
    from specroll.engine.spec.tree import TreeShape

    if arm.startswith("chain:"):
        return int(arm.removeprefix("chain:"))
    if arm.startswith("tree:"):
        return TreeShape.parse(arm.removeprefix("tree:")).depth
    return 0 if arm == "off" else max_k


@dataclass
class Arm:
    """An arm's runs at one batch size."""

    runs: list[RunStats] = field(default_factory=list)
    accepted: int = 0
    draft_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.draft_steps if self.draft_steps else None

    def accept_rate_per_pos(self, depth: int) -> list[float]:
        """P(draft j accepted) for draft positions (tree depths) j = 1..``depth``, over draft steps."""
        counts = self.accepted_per_pos + [0] * (depth - len(self.accepted_per_pos))
        return [n / self.draft_steps for n in counts] if self.draft_steps else []

    def tok_s(self) -> float:
        return pool_runs(self.runs).steady_tok_s

    def as_json(self, off: Arm | None, depth: int) -> dict[str, object]:
        tok_s = self.tok_s()
        ratio = tok_s / off.tok_s() if off is not None and off.tok_s() else None
        rounds = [r.steady_tok_s / o.steady_tok_s for r, o in zip(self.runs, off.runs, strict=False)
                  if o.steady_tok_s] if off is not None else []
        return {"tok_s": tok_s, "ratio": ratio, "ratios_per_round": rounds, "acceptance_length": self.acceptance_length,
                "accept_rate_per_pos": self.accept_rate_per_pos(depth), "draft_steps": self.draft_steps,
                "runs": len(self.runs), "load_average": self.runs[-1].load_average if self.runs else None}


class EngineBench:
    """The engine arms of one head (module docstring)."""

    def __init__(self, args: argparse.Namespace, checkpoint: Checkpoint, head: EagleHead,
                 prompts: list[list[int]]) -> None:
        self.args, self.checkpoint, self.head, self.prompts = args, checkpoint, head, prompts

    def engine(self, arm: str, batch_size: int):
        """A fresh engine for ``arm`` (``chain:k`` drafts k tokens; ``auto`` chooses k ≤ K and any shape)."""
        a = self.args
        k = int(arm.removeprefix("chain:")) if arm.startswith("chain:") else a.num_draft_tokens
        tree_args = argparse.Namespace(model=a.model, dtype=a.dtype, threads=a.threads, seed=a.seed,
                                       num_draft_tokens=k, shapes=a.shapes)
        return make_engine(tree_args, self.checkpoint, self.head, "chain" if arm.startswith("chain:") else arm,
                           batch_size)

    def requests(self, batch_size: int, max_tokens: int | None = None) -> list[Request]:
        from specroll.protocol.sampling import SamplingParams

        a = self.args
        count = max(len(self.prompts), a.requests_per_slot * batch_size)
        return [Request(f"t{i}", f"t{i}", self.prompts[i % len(self.prompts)],
                        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens or a.engine_max_tokens,
                                       seed=a.seed * 1_000_003 + i)) for i in range(count)]

    def run(self, arm: str, batch_size: int, into: Arm) -> None:
        engine = self.engine(arm, batch_size)
        _, stats = timed_run(engine, self.requests(batch_size), batch_size)
        s = engine.spec_stats
        into.runs.append(stats)
        into.accepted += s.num_accepted
        into.draft_steps += s.num_draft_steps
        for j, n in enumerate(s.accepted_per_pos):
            if j == len(into.accepted_per_pos):
                into.accepted_per_pos.append(0)
            into.accepted_per_pos[j] += n
        del engine
        gc.collect()

    def warm_up(self, arms: list[str]) -> None:
        for arm in arms:
            engine = self.engine(arm, 2)
            warm = self.requests(2, WARMUP_TOKENS)[:2]
            timed_run(engine, warm, 2)

    def measure(self) -> dict[str, object]:
        """Both phases of the module docstring; JSON-ready results."""
        a = self.args
        every = arm_names(a.shapes, a.num_draft_tokens)
        self.warm_up(every)
        batch1 = {arm: Arm() for arm in every}
        for arm in every:
            self.run(arm, 1, batch1[arm])
            r = batch1[arm].runs[-1]
            acc = batch1[arm].acceptance_length
            print(f"    B=1 {arm:>20}: {r.steady_tok_s:6.1f} tok/s, acceptance {acc or 1.0:.2f}, "
                  f"load {r.load_average:.1f}", flush=True)
        chains = [arm for arm in every if arm.startswith("chain:")]
        trees = [arm for arm in every if arm.startswith("tree:")]
        best_chain = max(chains, key=lambda arm: batch1[arm].tok_s())
        best_tree = max(trees, key=lambda arm: batch1[arm].tok_s()) if trees else None
        timed = [arm for arm in ("off", best_chain, best_tree, "auto") if arm is not None]
        speed: dict[str, dict[str, Arm]] = {}
        for b in a.batch_sizes:
            arms = {arm: batch1[arm] for arm in timed} if b == 1 else {arm: Arm() for arm in timed}
            for r in range(1 if b == 1 else 0, a.rounds):
                for arm in timed[r % len(timed):] + timed[: r % len(timed)]:
                    self.run(arm, b, arms[arm])
            speed[str(b)] = arms
            off = arms["off"].tok_s() or float("nan")
            print(f"    B={b}: " + ", ".join(f"{arm} {arms[arm].tok_s():.1f} tok/s ({arms[arm].tok_s() / off:.2f}x)"
                                              for arm in timed), flush=True)
        k = a.num_draft_tokens
        return {"batch1": {arm: batch1[arm].as_json(batch1["off"], arm_depth(arm, k)) for arm in every},
                "best_chain": best_chain, "best_tree": best_tree,
                "speed": {b: {arm: x.as_json(arms["off"], arm_depth(arm, k)) for arm, x in arms.items()}
                          for b, arms in speed.items()}}
