"""The trainer's metrics: its last step's figures as gauges (the same numbers as that step's
``metrics.jsonl`` line), running totals as counters, staleness and step times as histograms, the
generators it sees, and the launcher's restarts.

:meth:`TrainerExport.on_record` takes each record as it is appended to ``metrics.jsonl`` (a skipped
batch's and a held evaluation's included), so a scrape agrees with the file up to the line being
written; :meth:`TrainerExport.on_phase` the seconds of each trainer phase as it ends.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from specroll.actors.shared.restarts import read_restarts
from specroll.actors.telemetry import catalogue as c
from specroll.actors.telemetry.families import Buckets, family
from specroll.actors.telemetry.server_metrics import collect_hub

if TYPE_CHECKING:
    from specroll.actors.rollout.client import RolloutClient

_LAST_STEP = {  # gauge → the record's key
    c.REWARD: "reward_mean", c.ACCURACY: "accuracy", c.LOSS: "loss", c.GRAD_NORM: "grad_norm",
    c.APPROX_KL: "approx_kl", c.CLIP_FRACTION: "clip_fraction", c.DIFF_MEAN: "logprob_diff_mean",
    c.DIFF_MAX: "logprob_diff_max", c.KL_K3: "logprob_kl_k3", c.GEN_RATE: "gen_tokens_per_s",
    c.ACCEPTANCE: "acceptance_length", c.MISMATCH_TOKENS: "logprob_mismatch_tokens",
    c.TRUNCATED: "truncated_fraction", c.IS_WEIGHT: "is_weight_mean", c.MAX_LAG: "max_lag",
}
PHASES = ("wait", "train", "publish", "eval_wait")
"""The trainer's phases (``Trainer._phase``); any other is counted as ``other``."""
MAX_ROLES = 16
"""Most ``process`` label values of ``specroll:restarts`` (more are summed under ``other``)."""


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


class TrainerExport:
    """The trainer's live figures (module docstring).

    Args:
        client: the trainer's client: the generators registered and dead, read at scrape time.
        run_dir: the run directory: the launcher's restart counts (``restarts.json``), read at scrape
            time — so a restarted trainer goes on from the launcher's totals, never from 0.
        step: the step the trainer starts at (a resumed run's checkpoint).
        dropped: groups the trainer dropped that the hub did not (episode groups), by reason: added
            to the hub's in ``specroll:groups_dropped``; read at scrape time.
    """

    def __init__(self, client: RolloutClient, run_dir: Path, step: int = 0,
                 dropped: Mapping[str, int] | None = None) -> None:
        self.client, self.dropped = client, dropped
        self.last: dict[str, float] = {}
        """The last trained step's gauges, by record key."""
        self.step = step
        self.policy_version = 0
        self.eval_accuracy, self.eval_step = math.nan, -1
        self.samples = self.tokens = self.skipped = self.masked_stale = self.dropped_stale = 0
        self.staleness = Buckets(c.STALENESS.buckets)
        self.step_seconds = Buckets(c.STEP_SECONDS.buckets)
        self.phase_s: Counter[str] = Counter()
        self.run_dir = run_dir

    def on_record(self, record: dict[str, Any]) -> None:
        """A ``metrics.jsonl`` record was appended: update the gauges and totals."""
        step = record.get("step")
        if isinstance(record.get("eval_accuracy"), int | float) and isinstance(step, int):
            self.eval_accuracy, self.eval_step = float(record["eval_accuracy"]), step
        if "loss" not in record:
            return  # an evaluation's line of its own (the weights before the first step)
        self.masked_stale += int(record.get("tokens_masked_stale") or 0)
        self.dropped_stale += int(record.get("samples_dropped_stale") or 0)
        if record.get("skipped"):
            self.skipped += 1
            return
        if isinstance(step, int):
            self.step = step
        self.samples += int(record.get("samples") or 0)
        self.tokens += int(record.get("trained_tokens") or 0)
        staleness = record.get("staleness")
        if isinstance(staleness, dict):
            for lag, count in staleness.items():
                self.staleness.observe(float(lag), int(count))
        self.step_seconds.observe(_number(record.get("step_s")))
        self.last = {key: _number(record.get(key)) for key in _LAST_STEP.values()}

    def on_phase(self, phase: str, seconds: float, version: int) -> None:
        """A trainer phase of ``seconds`` ended, the trainer's policy at ``version`` (published when
        the phase is ``publish``: the gauge follows publishing, not the step's metrics line, which
        a held evaluation delays)."""
        self.phase_s[phase if phase in PHASES else "other"] += seconds
        self.policy_version = version

    def collect(self) -> Iterator[Metric]:
        """The trainer's families at one scrape (the catalogue's ``trainer`` and ``any`` metrics)."""
        last = dict(self.last)
        yield family(c.STEP, [((), self.step)])
        yield family(c.TRAINER_VERSION, [((), self.policy_version)])
        yield family(c.SAMPLES, [((), self.samples)])
        yield family(c.TRAINED_TOKENS, [((), self.tokens)])
        yield family(c.SKIPPED, [((), self.skipped)])
        for spec, key in _LAST_STEP.items():
            yield family(spec, [((), last.get(key, math.nan))])
        yield family(c.EVAL_ACCURACY, [((), self.eval_accuracy)])
        yield family(c.EVAL_STEP, [((), self.eval_step)])
        yield family(c.STALENESS, [((), self.staleness)])
        yield family(c.MASKED_STALE, [((), self.masked_stale)])
        yield family(c.DROPPED_STALE, [((), self.dropped_stale)])
        phases = dict(self.phase_s)
        yield family(c.PHASE_SECONDS, [((p,), phases.get(p, 0.0)) for p in (*PHASES, "other")])
        yield family(c.STEP_SECONDS, [((), self.step_seconds)])
        known = {"trainer": 0, **{actor: 0 for actor in list(self.client.coordinator.generators)}}
        by_role = read_restarts(self.run_dir)["restarts_by_role"]
        counted = {str(k): v for k, v in by_role.items()} if isinstance(by_role, dict) else {}
        restarts = sorted({**known, **counted}.items())  # every process seen, 0 included
        shown = restarts[:MAX_ROLES] + ([("other", sum(n for _, n in restarts[MAX_ROLES:]))]
                                        if len(restarts) > MAX_ROLES else [])
        yield family(c.RESTARTS, [((role,), n) for role, n in shown])
        yield from collect_hub(self.client, "trainer", "trainer", self.dropped)
