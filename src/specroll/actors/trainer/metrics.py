"""The trainer's metrics: one record per step (and per skipped batch, marked ``skipped``) for
``RUN_DIR/metrics.jsonl`` (wall-clock time, rewards, the loss and its diagnostics, staleness, the
training–inference logprob mismatch on lag-0 tokens, generation rate, acceptance length, the
generators' state; the trainer adds the held-out evaluation's ``eval_*`` fields to the line after
each evaluation), appended with the launcher's restart counts; the progress bar's summary of a
record; and, when a run resumes, whether an earlier trainer left lines there and the trimming of
that file back to a checkpoint's step.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specroll.actors.config import RunConfig
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.shared.files import append_line, write_text_atomic
from specroll.actors.shared.restarts import read_restarts
from specroll.actors.telemetry.sinks import RecordSinks
from specroll.actors.telemetry.trainer_metrics import TrainerExport
from specroll.actors.trainer.episode_metrics import response_lengths
from specroll.actors.trainer.group_drops import GroupDrops
from specroll.rl.coordinator import Group
from specroll.rl.episodes import EpisodeGroup
from specroll.rl.grpo_step import StepResult

log = logging.getLogger("specroll.trainer")

METRICS_FILENAME = "metrics.jsonl"


class StepMetrics:
    """Builds each training step's metrics record from the step and the client's view of the generators.

    Args:
        client: the trainer's client (generator stats, versions, deaths; drafter versions).
        acceptance_floor: ``drafter.acceptance_floor``: the drafter report warns below it.
        drops: the feeder's dropped groups (``groups_dropped`` by reason since the previous line,
            ``groups_dropped_total``); None leaves them out.
    """

    def __init__(self, client: RolloutClient, acceptance_floor: float, drops: GroupDrops | None = None) -> None:
        self.client, self.acceptance_floor, self.drops = client, acceptance_floor, drops
        self._gen_rate: dict[str, tuple[int, float, float]] = {}  # actor → (tokens, clock s, tokens/s)

    def _generation_rate(self) -> float | None:
        """Tokens/s of all live generators, each from its last two distinct ``Stats`` messages
        (None before any generator sent its first)."""
        total = 0.0
        live = [(a, s) for a, s in self.client.generator_stats.items() if a in self.client.coordinator.generators]
        if not live:
            return None
        for actor, s in live:
            clock = s.busy_s + s.idle_s
            prev = self._gen_rate.get(actor)
            if prev is None or clock < prev[1] or s.num_tokens < prev[0]:  # first stats, or it restarted
                rate = s.num_tokens / clock if clock > 0 else 0.0
            elif clock > prev[1]:
                rate = (s.num_tokens - prev[0]) / (clock - prev[1])
            else:
                rate = prev[2]  # no new stats since the last step
            self._gen_rate[actor] = (s.num_tokens, clock, rate)
            total += rate
        return total

    def _acceptance_length(self) -> float | None:
        """1 + accepted drafts per draft step over all generators (None without speculation)."""
        specs = [s.spec for s in self.client.generator_stats.values() if s.spec is not None]
        steps = sum(s.num_draft_steps for s in specs)
        return 1 + sum(s.num_accepted for s in specs) / steps if steps else None

    def record(self, step: int, version: int, groups: Sequence[Group | EpisodeGroup], rewards: torch.Tensor,
               r: StepResult, trained_version: int, step_s: float, wait_s: float, train_s: float | None = None,
               threads_borrowed: float | None = None) -> dict[str, object]:
        """The record of step ``step``, after which the policy is at ``version``. A skipped batch
        (``r.skipped``: no token in the loss, no optimizer step) has a record of its own with
        ``"skipped": true``, ``trained_tokens`` 0 and ``step`` the step it was drawn for; the next
        batch is drawn for that step again (``Trainer``), so a skipped line precedes that step's line.

        Args:
            groups: the groups trained on; ``rewards`` their rewards ``[G, n]``.
            r: the optimizer step's result.
            trained_version: the policy version the step trained.
            step_s: seconds the step took; ``wait_s`` seconds it waited for its groups; ``train_s``
                seconds of them its optimizer step took (rewards, packing, forward, backward, AdamW).
            threads_borrowed: the share of the step's phases that ran with the generators' idle
                threads (``thread_budget.ThreadBudget``); None when it never borrows.
        """
        lengths = [n for g in groups for n in response_lengths(g)]
        m = r.mismatch
        return {
            "step": step,
            "time": time.time(),
            "samples": len(lengths),
            "policy_version": version,
            "trained_version": trained_version,
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards >= 1.0).float().mean()),
            "loss": r.loss,
            "is_weight_mean": r.is_weight_mean,
            "truncated_fraction": r.truncated_fraction,
            "clip_fraction": r.clip_fraction,
            "approx_kl": r.approx_kl,
            "grad_norm": r.grad_norm,
            "trained_tokens": r.trained_tokens,
            "skipped": r.skipped,
            "tokens_masked_stale": r.tokens_masked_stale,
            "samples_dropped_stale": r.samples_dropped_stale,
            "staleness": {str(lag): count for lag, count in r.staleness.items()},
            "max_lag": r.max_lag,
            "logprob_diff_mean": m.diff_mean,
            "logprob_diff_max": m.diff_max,
            "logprob_kl_k3": m.kl_k3,
            "logprob_mismatch_tokens": m.tokens,
            "response_tokens_mean": sum(lengths) / len(lengths),
            "gen_tokens_per_s": self._generation_rate(),
            "acceptance_length": self._acceptance_length(),
            **self.client.drafters.report(self.acceptance_floor),
            "generators_alive": len(self.client.coordinator.generators),
            "generators_dead": len(self.client.dead_generators),
            "generator_versions": dict(self.client.generator_versions),
            "groups_resumed": self.client.coordinator.resumed_groups,
            **(self.drops.metrics() if self.drops is not None else {}),
            "step_s": step_s,
            "wait_s": wait_s,
            "train_s": train_s,
            "threads_borrowed": threads_borrowed,
        }


class RecordLog:
    """Where each step's record goes: appended to ``RUN_DIR/metrics.jsonl`` (:func:`append_metrics`),
    then to the live export (``/metrics``) and the W&B / TensorBoard sinks, when configured.

    Args:
        run_dir: the run directory.
        export: the trainer's live figures (``/metrics`` serves them when ``[metrics] enabled``).
        sinks: the W&B / TensorBoard sinks, or None.
    """

    def __init__(self, run_dir: Path, export: TrainerExport, sinks: RecordSinks | None = None) -> None:
        self.run_dir, self.export, self.sinks = run_dir, export, sinks

    @classmethod
    def open(cls, config: RunConfig, client: RolloutClient, step: int, drops: GroupDrops | None = None) -> RecordLog:
        """The trainer's record log, from step ``step``, with the sinks ``[metrics]`` enables; ``drops``:
        the feeder's dropped groups (those the hub did not drop are added to ``specroll:groups_dropped``).

        Raises:
            ~specroll.actors.telemetry.sinks.MetricsSinkUnavailable: a sink's package is not installed.
        """
        run_dir = Path(config.run_dir)
        export = TrainerExport(client, run_dir, step, drops.not_in_hub if drops is not None else None)
        return cls(run_dir, export, RecordSinks.open(config, run_dir))

    def close(self) -> None:
        """Close the sinks (idempotent)."""
        if self.sinks is not None:
            self.sinks.close()

    def append(self, record: dict[str, object]) -> None:
        """Append ``record`` (with the launcher's restart counts) and hand it on."""
        append_metrics(self.run_dir, record)
        self.export.on_record(record)
        if self.sinks is not None:
            self.sinks.write(record)


def append_metrics(run_dir: Path, metrics: dict[str, object]) -> None:
    """Append one record to ``RUN_DIR/metrics.jsonl``, with what the launcher restarted so far
    (``RUN_DIR/restarts.json``)."""
    metrics.update(read_restarts(run_dir))  # what the launcher restarted so far
    append_line(run_dir / METRICS_FILENAME, json.dumps(metrics))


def progress(metrics: dict[str, object], result: StepResult) -> str:
    """The progress bar's postfix for one step."""
    parts = [f"v{metrics['policy_version']} reward {metrics['reward_mean']:.3f}"]
    if metrics.get("eval_accuracy") is not None:
        parts.append(f"eval {metrics['eval_accuracy']:.3f}")
    if metrics["gen_tokens_per_s"] is not None:
        parts.append(f"{metrics['gen_tokens_per_s']:.0f} tok/s")
    parts.append(f"lag<={result.max_lag} masked {result.tokens_masked_stale}")
    if metrics["acceptance_length"] is not None:
        parts.append(f"accept {metrics['acceptance_length']:.2f}")
    return " ".join(parts)


def earlier_incarnation(run_dir: Path) -> bool:
    """Whether an earlier trainer of this run left progress in the run directory (metrics lines, or
    a trainer restart the launcher recorded) — without a checkpoint, it may still have published
    versions the generators serve."""
    metrics = run_dir / METRICS_FILENAME
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    by_role = read_restarts(run_dir)["restarts_by_role"]
    return isinstance(by_role, dict) and by_role.get("trainer", 0) > 0


def truncate_metrics(path: Path, step: int, evaluated_again: bool = False) -> dict[str, object] | None:
    """Keep the metrics of steps up to ``step`` (the checkpoint resumed from, or 0 after an earlier
    incarnation that wrote no checkpoint): the steps a killed trainer ran past it are trained again,
    so their lines are replaced, not repeated.

    Args:
        evaluated_again: the restarted trainer evaluates the weights of ``step`` again, and writes
            their figures into a line of ``step`` of its own: the old line of ``step`` is taken out
            too. Step 0's is an evaluation's line only, and is dropped; a later step's (its last
            one not ``skipped``) is returned without its ``eval_*`` fields, for the trainer to hold
            and write again with the new evaluation's.

    Returns:
        The line of ``step`` taken out to be written again, or None.
    """
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept: list[str] = []
    again: tuple[int, dict[str, object]] | None = None  # (index in kept, record) of step's line
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step):
            continue
        if evaluated_again and record["step"] == step:
            if step == 0:
                continue
            if not record.get("skipped"):
                again = (len(kept), record)
        kept.append(line if line.endswith("\n") else line + "\n")
    held = None
    if again is not None:
        del kept[again[0]]
        held = {k: v for k, v in again[1].items() if not k.startswith("eval_")}
    if len(kept) != len(lines):
        log.info("metrics: dropping %d lines of steps trained or evaluated again (resuming at step %d)",
                 len(lines) - len(kept), step)
        write_text_atomic(path, "".join(kept))
    return held
