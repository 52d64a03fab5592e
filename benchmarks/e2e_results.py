"""What one arm of the end-to-end benchmark measured, and the summary over seeds (ratios, mean ± SE).

Times are seconds of wall clock from the arm's start (the moment its first process was started), so
every arm pays its own start-up (imports, model loading) the same way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from e2e_settings import ENGINE_DTYPE, Arm, Precision

Status = Literal["ok", "skipped", "failed"]


@dataclass
class ArmResult:
    """One arm on one seed. ``status`` is ``ok``, ``skipped`` (``reason`` says why) or ``failed``."""

    arm: Arm
    seed: int
    status: Status = "ok"
    reason: str | None = None
    rewards: list[float] = field(default_factory=list)
    """Mean training reward of step 1..N (the trained batch's)."""
    step_end_s: list[float] = field(default_factory=list)
    """Seconds from the arm's start to the end of step 1..N (evaluation time included)."""
    train_start_s: float | None = None
    """Seconds from the arm's start to the start of step 1 (start-up: imports, model loading)."""
    eval_accuracy: dict[int, float] = field(default_factory=dict)
    """Evaluated step (0 = before training) → held-out accuracy of the weights after it."""
    wall_s: float = 0.0
    """Arm start → end of step N, including its last evaluation (specroll's last metrics line waits for it)."""
    eval_s: float = 0.0
    """Evaluation seconds on the trainer's critical path: all of TRL's (subtracted in
    ``wall_s_without_eval``); for specroll, whose generators evaluate while training goes on, the
    trainer's ``eval_wait`` phases (its next publish waits for a running evaluation)."""
    wall_s_without_eval: float | None = None
    """TRL only: ``wall_s`` less its evaluations (and its one-off parity check)."""
    eval_s_until: list[float] = field(default_factory=list)
    """TRL only: evaluation (and check) seconds spent before the end of step 1..N."""
    trainer_span_s: float | None = None
    """specroll only: the trainer's own span, start of step 1 (``time - step_s - wait_s`` of the first
    metrics line) → the last line's ``time``."""
    samples: int = 0
    """Trained samples over the N steps."""
    extra: dict[str, object] = field(default_factory=dict)
    """Arm-specific facts (engine dtype, acceptance length, per-step seconds, ...)."""

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.wall_s if self.status == "ok" and self.wall_s > 0 else None

    @property
    def samples_per_s_without_eval(self) -> float | None:
        w = self.wall_s_without_eval
        return self.samples / w if self.status == "ok" and w else self.samples_per_s

    @property
    def final_accuracy(self) -> float | None:
        return self.eval_accuracy[max(self.eval_accuracy)] if self.eval_accuracy else None

    def time_to_accuracy(self, target: float, without_eval: bool = False) -> float | None:
        """Seconds from the arm's start until the weights that first reached ``target`` existed (the end
        of the step they came from; step 0: the start of step 1); None when never reached."""
        for step in sorted(self.eval_accuracy):
            if self.eval_accuracy[step] >= target:
                if step == 0:
                    return self.train_start_s
                t = self.step_end_s[step - 1]
                return t - self.eval_s_until[step - 1] if without_eval and self.eval_s_until else t
        return None

    def to_json(self, target: float) -> dict[str, object]:
        out = asdict(self)
        out["eval_accuracy"] = [{"step": s, "accuracy": a} for s, a in sorted(self.eval_accuracy.items())]
        out.update(samples_per_s=self.samples_per_s, samples_per_s_without_eval=self.samples_per_s_without_eval,
                   final_eval_accuracy=self.final_accuracy, target_accuracy=target,
                   time_to_target_s=self.time_to_accuracy(target),
                   time_to_target_s_without_eval=self.time_to_accuracy(target, without_eval=True))
        return out


def mean_se(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and standard error (sample std / √n; None for fewer than two values)."""
    if not values:
        return None, None
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def summarize(results: Sequence[ArmResult], arms: Sequence[Arm], target: float) -> dict[str, object]:
    """Per arm: mean samples/s over seeds (TRL also without its evaluation time), final evaluation
    accuracy mean ± SE, time to ``target``; and the ratios of mean samples/s between arms. A ratio
    against TRL uses TRL's wall time without evaluation (conservative for specroll: its evaluation
    overlaps training and stays in its wall time); ``*_with_eval`` uses TRL's full wall time."""
    per_arm: dict[str, dict[str, object]] = {}
    for arm in arms:
        ok = [r for r in results if r.arm == arm and r.status == "ok"]
        if not ok:
            skipped = [r.reason for r in results if r.arm == arm and r.reason]
            per_arm[arm] = {"status": "skipped" if skipped else "failed", "reason": skipped[0] if skipped else None}
            continue
        acc_mean, acc_se = mean_se([r.final_accuracy for r in ok if r.final_accuracy is not None])
        reached = [t for r in ok if (t := r.time_to_accuracy(target)) is not None]
        per_arm[arm] = {
            "status": "ok", "seeds": [r.seed for r in ok],
            "samples_per_s": statistics.fmean(r.samples_per_s or 0.0 for r in ok),
            "samples_per_s_without_eval": statistics.fmean(r.samples_per_s_without_eval or 0.0 for r in ok),
            "wall_s": statistics.fmean(r.wall_s for r in ok),
            "final_eval_accuracy_mean": acc_mean, "final_eval_accuracy_se": acc_se,
            "time_to_target_s_mean": statistics.fmean(reached) if reached else None,
            "target_reached": f"{len(reached)}/{len(ok)}",
        }
    ratios: dict[str, float] = {}
    for a, b in (("specroll", "trl"), ("sync", "trl"), ("specroll", "sync")):
        pa, pb = per_arm.get(a, {}), per_arm.get(b, {})
        if pa.get("status") == "ok" and pb.get("status") == "ok":
            ratios[f"{a}/{b}"] = pa["samples_per_s"] / pb["samples_per_s_without_eval"]  # type: ignore[operator]
            if b == "trl":
                ratios[f"{a}/{b}_with_eval"] = pa["samples_per_s"] / pb["samples_per_s"]  # type: ignore[operator]
    initial = {f"{r.arm}-seed{r.seed}": r.eval_accuracy[0] for r in results
               if r.status == "ok" and 0 in r.eval_accuracy}  # the same weights, prompts and seeds in every run
    return {"arms": per_arm, "ratios": ratios, "step0_eval_accuracy": initial,
            "step0_consistent": len(set(initial.values())) <= 1}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(results: Sequence[ArmResult], summary: dict[str, object], target: float,
                 precision: Precision) -> None:
    """The precision every arm ran at, the per-run table, the per-arm means and the ratios."""
    print(f"precision {precision}: TRL bf16={precision == 'bf16'}; specroll trainer.precision={precision}, "
          f"generators {ENGINE_DTYPE[precision]}")
    print(f"{'arm':<9}{'seed':>5}{'wall s':>9}{'w/o eval':>9}{'samples/s*':>11}{'reward':>8}{'eval acc':>10}"
          f"{f't>={target:g} s':>11}")
    for r in results:
        if r.status != "ok":
            print(f"{r.arm:<9}{r.seed:>5}  {r.status}: {r.reason}")
            continue
        rewards = statistics.fmean(r.rewards) if r.rewards else None
        print(f"{r.arm:<9}{r.seed:>5}{r.wall_s:>9.1f}{_fmt(r.wall_s_without_eval, '.1f'):>9}"
              f"{_fmt(r.samples_per_s_without_eval, '.3f'):>11}{_fmt(rewards, '.3f'):>8}"
              f"{_fmt(r.final_accuracy, '.3f'):>10}{_fmt(r.time_to_accuracy(target), '.1f'):>11}")
    print("* trained samples / wall time, TRL's without its evaluations; reward: mean over the steps; eval acc: "
          "after the last step")
    arms: dict[str, dict[str, object]] = summary["arms"]  # type: ignore[assignment]
    for arm, s in arms.items():
        if s["status"] != "ok":
            print(f"{arm}: {s['status']} ({s['reason']})")
            continue
        se = s["final_eval_accuracy_se"]
        print(f"{arm}: {s['samples_per_s_without_eval']:.3f} trained samples/s (mean over seeds {s['seeds']}), "
              f"final eval accuracy {_fmt(s['final_eval_accuracy_mean'], '.3f')}"  # type: ignore[arg-type]
              f" ± {_fmt(se, '.3f')} (SE), target {target:g} reached {s['target_reached']}")  # type: ignore[arg-type]
    for name, value in summary["ratios"].items():  # type: ignore[attr-defined]
        print(f"samples/s {name}: {value:.2f}")
    if not summary["step0_consistent"]:
        # Every run evaluates the same initial weights on the same prompts with the same seeds per prompt.
        print(f"warning: the evaluations before training disagree, {summary['step0_eval_accuracy']}: the arms "
              "are not evaluated identically (different random numbers or numerics)")
