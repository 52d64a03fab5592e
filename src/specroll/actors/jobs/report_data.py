"""What ``specroll report`` reads from a run directory: ``metrics.jsonl`` (one record per step),
``timeline.jsonl`` (events, see :mod:`specroll.actors.rollout.timeline`) and the group size from
``config.toml``, turned into typed records.

Reading tolerates a run that was killed or is still going: a missing file, a malformed line, a
line cut short at the end or a field of the wrong type becomes one warning naming the file and
line (:attr:`RunData.warnings`) and the rest is kept. Only a run with no metrics at all is an error.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specroll.actors.jobs.report_lines import Fields, read_jsonl, show
from specroll.actors.rollout.timeline import TIMELINE_FILENAME

METRICS_FILENAME = "metrics.jsonl"
CONFIG_FILENAME = "config.toml"

Phase = Literal["wait", "train", "publish", "eval_wait", "checkpoint"]
PHASES: tuple[Phase, ...] = ("train", "wait", "publish", "eval_wait", "checkpoint")
ArrivalKind = Literal["policy_published", "policy_served", "drafter_published", "drafter_served"]
ARRIVALS: tuple[ArrivalKind, ...] = ("policy_published", "policy_served", "drafter_published", "drafter_served")


class ReportError(Exception):
    """The run directory cannot be reported on (not a directory, no metrics); ``warnings`` are the
    lines that could not be read on the way."""

    def __init__(self, message: str, warnings: list[str] | None = None) -> None:
        super().__init__(message)
        self.warnings = warnings or []


@dataclass(frozen=True)
class AcceptancePair:
    """Speculation of one step under one (drafter version, policy version) pair."""

    drafter_version: int
    acceptance_length: float
    """Tokens emitted per verify step."""
    draft_steps: int
    """Verify steps it was measured over (the weight when versions are aggregated)."""


@dataclass
class StepRecord:
    """The fields of one metrics line the report draws; None where the line lacks one."""

    step: int
    time: float | None = None
    """Wall-clock seconds since the epoch at the end of the step."""
    reward_mean: float | None = None
    accuracy: float | None = None
    eval_accuracy: float | None = None
    eval_step: int | None = None
    """The step whose weights ``eval_accuracy`` measured (0: before training); the line that carries
    an evaluation is the next one written after it finished."""
    samples: int | None = None
    """Samples trained on (the ``samples`` field)."""
    samples_dropped: int = 0
    step_s: float | None = None
    wait_s: float | None = None
    gen_tokens_per_s: float | None = None
    staleness: dict[int, int] = field(default_factory=dict)
    """Policy-version lag → trained tokens with that lag."""
    max_lag: int | None = None
    acceptance: list[AcceptancePair] = field(default_factory=list)


@dataclass(frozen=True)
class LoadPoint:
    """A generator's heartbeat: ``live`` sequences decoding out of ``capacity``, at ``t`` (epoch s)."""

    t: float
    actor: str
    live: int
    capacity: int | None


@dataclass(frozen=True)
class PhaseSpan:
    """The trainer in ``phase`` from ``start`` to ``end`` (epoch s)."""

    phase: Phase
    start: float
    end: float
    step: int | None


@dataclass(frozen=True)
class Arrival:
    """A policy or drafter version published (``actor`` None) or served by a generator, at ``t``."""

    t: float
    kind: ArrivalKind
    version: int | None
    actor: str | None


@dataclass
class RunData:
    """Everything the report draws, and what could not be read."""

    run_dir: Path
    steps: list[StepRecord]
    loads: list[LoadPoint] = field(default_factory=list)
    phases: list[PhaseSpan] = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)
    step_groups: dict[int, int] = field(default_factory=dict)
    """Step → number of groups it trained on (``step_groups`` events)."""
    group_size: int | None = None
    batch_groups: int | None = None
    has_timeline: bool = False
    warnings: list[str] = field(default_factory=list)
    """One line per file missing or line not (fully) read: file, line number, what was wrong."""

    @property
    def t0(self) -> float | None:
        """The earliest timeline time (epoch s): x = 0 of the timeline figure."""
        times = [p.t for p in self.loads] + [p.start for p in self.phases] + [a.t for a in self.arrivals]
        return min(times) if times else None


def _staleness(f: Fields) -> dict[int, int]:
    value = f.record.get("staleness")
    if value is None:
        return {}
    if isinstance(value, dict) and all(str(k).isdigit() and isinstance(v, int) and not isinstance(v, bool)
                                       for k, v in value.items()):
        return {int(k): v for k, v in value.items()}
    f.bad.append(f"staleness={show(value)} (expected {{lag: tokens}})")
    return {}


def _acceptance(f: Fields) -> list[AcceptancePair]:
    value = f.record.get("acceptance_by_version")
    if value is None:
        return []
    pairs = []
    for item in value if isinstance(value, list) else [value]:
        p = Fields(item) if isinstance(item, dict) else None
        if p is None:
            f.bad.append(f"acceptance_by_version item {show(item)} (expected an object)")
            continue
        version, length, steps = p.integer("drafter_version"), p.number("acceptance_length"), p.integer("draft_steps")
        if p.bad or version is None or length is None or steps is None:
            f.bad.append(f"acceptance_by_version item {show(item)} (expected drafter_version, acceptance_length, "
                         "draft_steps)")
            continue
        pairs.append(AcceptancePair(version, length, steps))
    return pairs


def _step_record(path: Path, number: int, record: dict[str, object], warnings: list[str]) -> StepRecord | None:
    f = Fields(record)
    step = f.integer("step", required=True)
    if step is None:
        f.warn(path, number, warnings)
        return None
    r = StepRecord(step=step, time=f.number("time"), reward_mean=f.number("reward_mean"),
                   accuracy=f.number("accuracy"), eval_accuracy=f.number("eval_accuracy"),
                   eval_step=f.integer("eval_step"),
                   samples=f.integer("samples"), samples_dropped=f.integer("samples_dropped_stale") or 0,
                   step_s=f.number("step_s"), wait_s=f.number("wait_s"), gen_tokens_per_s=f.number("gen_tokens_per_s"),
                   staleness=_staleness(f), max_lag=f.integer("max_lag"), acceptance=_acceptance(f))
    f.warn(path, number, warnings)
    return r


def _read_timeline(data: RunData) -> None:
    path = data.run_dir / TIMELINE_FILENAME
    data.has_timeline = path.is_file()
    for number, record in read_jsonl(path, data.warnings):
        f = Fields(record)
        t, event = f.number("t", required=True), f.text("event", required=True)
        if t is None or event is None:
            pass
        elif event == "generator_load":
            actor, live = f.text("actor", required=True), f.integer("live", required=True)
            if actor is not None and live is not None:
                data.loads.append(LoadPoint(t, actor, live, f.integer("capacity")))
        elif event == "phase":
            phase, start, end = f.text("phase"), f.number("start", required=True), f.number("end", required=True)
            if phase not in PHASES:
                f.bad.append(f"phase={show(phase)} (expected one of {', '.join(PHASES)})")
            elif start is not None and end is not None:
                data.phases.append(PhaseSpan(phase, start, end, f.integer("step")))
        elif event == "step_groups":
            step, groups = f.integer("step", required=True), record.get("group_ids")
            if not isinstance(groups, list):
                f.bad.append(f"group_ids={show(groups)} (expected a list)")
            elif step is not None:
                data.step_groups[step] = len(groups)
        elif event in ARRIVALS:
            data.arrivals.append(Arrival(t, event, f.integer("version"), f.text("actor")))
        # other events (group_finished, evaluation, later additions) are not drawn
        f.warn(path, number, data.warnings)


def _read_config(data: RunData) -> None:
    """``trainer.group_size`` and ``trainer.batch_groups`` of the resolved config, when readable."""
    path = data.run_dir / CONFIG_FILENAME
    try:
        trainer = tomllib.loads(path.read_text(encoding="utf-8")).get("trainer", {})
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        data.warnings.append(f"{path}: cannot be read ({e}); samples per step only from the metrics")
        return
    if isinstance(trainer, dict):
        f = Fields(trainer)
        data.group_size, data.batch_groups = f.integer("group_size"), f.integer("batch_groups")


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory (metrics, timeline, config), keeping what is readable.

    Raises:
        ReportError: ``run_dir`` is not a directory, or its ``metrics.jsonl`` holds no step record
            (the message names what was found).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is not a directory"
        raise ReportError(f"run directory {str(run_dir)!r} {what}, expected the RUN_DIR of 'specroll launch'")
    data = RunData(run_dir, steps=[])
    metrics = run_dir / METRICS_FILENAME
    if not metrics.is_file():
        raise ReportError(f"{metrics} is missing: nothing to report (has the run finished a step?)")
    by_step: dict[int, StepRecord] = {}
    for number, record in read_jsonl(metrics, data.warnings):
        if isinstance(record, dict) and record.get("skipped") is True:
            continue  # a batch with nothing to train: no step (the step's own line follows)
        step = _step_record(metrics, number, record, data.warnings)
        if step is not None:
            by_step[step.step] = step  # a step written twice (a resumed run): the later line
    if not by_step:
        raise ReportError(f"{metrics} holds no step record: nothing to report (has the run finished a step?)",
                          data.warnings)
    data.steps = [by_step[s] for s in sorted(by_step)]
    _read_timeline(data)
    _read_config(data)
    return data


def trained_samples(data: RunData, r: StepRecord) -> int | None:
    """Samples step ``r`` trained on: its ``samples`` field, else its groups (``step_groups`` event,
    else ``trainer.batch_groups``) × ``trainer.group_size`` less the samples dropped as stale."""
    if r.samples is not None:
        return r.samples
    if r.reward_mean is None:
        return None  # not a training step (step 0: the evaluation before training)
    groups = data.step_groups.get(r.step, data.batch_groups)
    if groups is None or data.group_size is None:
        return None
    return max(groups * data.group_size - r.samples_dropped, 0)


def samples_per_s(data: RunData) -> list[tuple[int, float]]:
    """(step, trained samples/s): samples / (time[i] − time[i−1]) between consecutive steps with a
    ``time``, else samples / (step_s + wait_s); steps without either are left out."""
    rates = []
    previous: StepRecord | None = None
    for r in data.steps:
        samples = trained_samples(data, r)
        seconds = None
        if previous is not None and previous.step == r.step - 1 and r.time is not None and previous.time is not None:
            seconds = r.time - previous.time
        if (seconds is None or seconds <= 0) and r.step_s is not None:
            seconds = r.step_s + (r.wait_s or 0.0)
        if samples is not None and seconds is not None and seconds > 0:
            rates.append((r.step, samples / seconds))
        previous = r
    return rates


def acceptance_by_drafter(steps: list[StepRecord]) -> dict[int, tuple[float, int]]:
    """Drafter version → (acceptance length averaged over its verify steps, verify steps):
    Σ length·draft_steps / Σ draft_steps over every step and policy version."""
    sums: dict[int, tuple[float, int]] = {}
    for r in steps:
        for p in r.acceptance:
            if p.draft_steps > 0:
                total, n = sums.get(p.drafter_version, (0.0, 0))
                sums[p.drafter_version] = (total + p.acceptance_length * p.draft_steps, n + p.draft_steps)
    return {v: (total / n, n) for v, (total, n) in sorted(sums.items())}
