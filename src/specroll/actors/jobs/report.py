"""``specroll report RUN_DIR [--out DIR]``: draw a run's metrics and timeline as PNGs.

Figures (in ``--out``, default ``RUN_DIR/report/``):

* ``reward.png`` — ``reward_mean`` and ``accuracy`` per step with a trailing rolling mean over
  :data:`ROLLING_WINDOW` steps, and ``eval_accuracy`` on the steps that have one;
* ``throughput.png`` — trained samples/s per step (:func:`~specroll.actors.jobs.report_data.samples_per_s`)
  and the generators' ``gen_tokens_per_s``;
* ``staleness.png`` — the trained tokens of each step stacked by policy-version lag, and ``max_lag``;
* ``acceptance.png`` — acceptance length per drafter version (weighted by verify steps) and per
  step; a note when the run had no speculation;
* ``timeline.png`` — the run over wall time (:mod:`~specroll.actors.jobs.report_timeline`).

Rendering is matplotlib's Agg canvas on :class:`~matplotlib.figure.Figure` objects: no pyplot, no
display, no global state.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from specroll.actors.jobs.report_data import (
    ReportError,
    RunData,
    StepRecord,
    acceptance_by_drafter,
    load_run,
    samples_per_s,
)
from specroll.actors.jobs.report_timeline import draw_timeline, note
from specroll.actors.shared.exit_codes import EXIT_OK, EXIT_REFUSED

PROG = "specroll report"
ROLLING_WINDOW = 5
"""Steps in the trailing rolling mean of the reward figure."""
REPORT_DIRNAME = "report"


def rolling_mean(values: list[float], window: int = ROLLING_WINDOW) -> list[float]:
    """Trailing mean: element i is the mean of ``values[max(0, i - window + 1) : i + 1]`` (the last
    ``window`` values with one, fewer at the start)."""
    means = []
    for i in range(len(values)):
        last = values[max(0, i - window + 1) : i + 1]
        means.append(sum(last) / len(last))
    return means


def _series(steps: list[StepRecord], get: Callable[[StepRecord], float | None]) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where ``get`` gives a value."""
    pairs = [(r.step, v) for r in steps if (v := get(r)) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _with_rolling(ax: Axes, x: list[int], y: list[float], label: str, color: str) -> None:
    ax.plot(x, y, color=color, alpha=0.35, linewidth=1, marker=".", label=label)
    ax.plot(x, rolling_mean(y), color=color, linewidth=2, label=f"{label} (rolling mean, {ROLLING_WINDOW} steps)")


def draw_reward(data: RunData) -> Figure:
    """``reward.png``: reward_mean (top), accuracy and eval_accuracy (bottom) per step."""
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    x, y = _series(data.steps, lambda r: r.reward_mean)
    if x:
        _with_rolling(top, x, y, "reward_mean", "tab:blue")
        top.legend(fontsize=8)
    else:
        note(top, "no reward_mean in the metrics")
    top.set_ylabel("reward (mean over samples)")
    x, y = _series(data.steps, lambda r: r.accuracy)
    if x:
        _with_rolling(bottom, x, y, "accuracy", "tab:green")
    evals = sorted((r.step if r.eval_step is None else r.eval_step, r.eval_accuracy) for r in data.steps
                   if r.eval_accuracy is not None)  # at the step whose weights were evaluated
    ex, ey = [e[0] for e in evals], [e[1] for e in evals]
    if ex:
        bottom.plot(ex, ey, color="tab:red", marker="o", linewidth=1.5,
                    label="eval_accuracy (held out; x = weights after step)")
    if x or ex:
        bottom.legend(fontsize=8)
        bottom.set_ylim(-0.02, 1.02)
    else:
        note(bottom, "no accuracy in the metrics")
    bottom.set_ylabel("accuracy (fraction)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{data.run_dir.name}: reward")
    return fig


def draw_throughput(data: RunData) -> Figure:
    """``throughput.png``: trained samples/s (top) and generated tokens/s (bottom) per step."""
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    rates = samples_per_s(data)
    if rates:
        top.plot([s for s, _ in rates], [r for _, r in rates], color="tab:blue", marker="o")
        top.set_ylim(bottom=0)
    else:
        note(top, "no samples count or step time in the metrics")
    top.set_ylabel("trained samples/s")
    x, y = _series(data.steps, lambda r: r.gen_tokens_per_s)
    if x:
        bottom.plot(x, y, color="tab:orange", marker="o")
        bottom.set_ylim(bottom=0)
    else:
        note(bottom, "no gen_tokens_per_s in the metrics")
    bottom.set_ylabel("generated tokens/s (all generators)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{data.run_dir.name}: throughput")
    return fig


def draw_staleness(data: RunData) -> Figure:
    """``staleness.png``: trained tokens per step stacked by lag, max_lag on the right axis."""
    fig = Figure(figsize=(10, 5), layout="constrained")
    ax = fig.subplots()
    lags = sorted({lag for r in data.steps for lag in r.staleness})
    if not lags:
        note(ax, "no staleness in the metrics")
        fig.suptitle(f"{data.run_dir.name}: staleness")
        return fig
    steps = [r.step for r in data.steps]
    bottom = [0] * len(steps)
    colors = _colormap(len(lags))
    for lag, color in zip(lags, colors, strict=True):
        counts = [r.staleness.get(lag, 0) for r in data.steps]
        ax.bar(steps, counts, bottom=bottom, color=color, label=f"lag {lag}" if len(lags) <= 12 else None)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylabel("trained tokens, by policy-version lag")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    x, y = _series(data.steps, lambda r: None if r.max_lag is None else float(r.max_lag))
    if x:
        twin = ax.twinx()
        twin.plot(x, y, color="black", marker="o", linewidth=1.2, label="max_lag")
        twin.set_ylabel("max lag (policy versions)")
        twin.set_ylim(bottom=0, top=max(y) + 1)
        twin.yaxis.set_major_locator(MaxNLocator(integer=True))
        twin.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8, title="stacked", title_fontsize=8)
    fig.suptitle(f"{data.run_dir.name}: staleness of the trained tokens")
    return fig


def _colormap(n: int) -> list[tuple[float, float, float, float]]:
    cmap = colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def draw_acceptance(data: RunData) -> Figure:
    """``acceptance.png``: acceptance length per drafter version and per step (or a note)."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    by_version = acceptance_by_drafter(data.steps)
    if not by_version:
        note(fig.add_subplot(), "no speculation in this run (no acceptance_by_version with verify steps)")
        fig.suptitle(f"{data.run_dir.name}: acceptance length")
        return fig
    left, right = fig.subplots(1, 2, width_ratios=(1, 2))
    versions = list(by_version)
    left.bar([str(v) for v in versions], [by_version[v][0] for v in versions], color="tab:purple")
    for i, v in enumerate(versions):
        left.annotate(f"{by_version[v][1]} verify steps", (i, by_version[v][0]), ha="center", va="bottom", fontsize=7)
    left.set_xlabel("drafter version")
    left.set_ylabel("acceptance length (tokens per verify step)")
    left.set_ylim(bottom=1.0 if min(m for m, _ in by_version.values()) >= 1.0 else 0.0)
    colors = dict(zip(versions, _colormap(len(versions)), strict=True))
    per_step = [(r.step, acceptance_by_drafter([r])) for r in data.steps]
    for v in versions:
        points = [(step, by[v][0]) for step, by in per_step if v in by]
        right.plot([s for s, _ in points], [a for _, a in points], marker="o", color=colors[v], label=f"drafter v{v}")
    right.set_xlabel("step")
    right.set_ylabel("acceptance length in the step")
    right.legend(fontsize=8)
    fig.suptitle(f"{data.run_dir.name}: acceptance length (weighted by verify steps)")
    return fig


FIGURES: dict[str, Callable[[RunData], Figure]] = {
    "reward.png": draw_reward,
    "throughput.png": draw_throughput,
    "staleness.png": draw_staleness,
    "acceptance.png": draw_acceptance,
    "timeline.png": draw_timeline,
}
"""File name → the function drawing it, in the order they are written."""


def write_report(data: RunData, out: Path) -> list[Path]:
    """Draw every figure of :data:`FIGURES` into ``out`` (created if missing). Returns the paths.

    Raises:
        OSError: ``out`` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in FIGURES.items():
        fig = draw(data)
        FigureCanvasAgg(fig)  # attaches the Agg canvas savefig renders with
        fig.savefig(out / name, dpi=100)
        paths.append(out / name)
    return paths


def run_report(run_dir: str, out: str | None = None, stdout: IO[str] | None = None,
               stderr: IO[str] | None = None) -> int:
    """``specroll report``: read ``run_dir``, print one warning line per unreadable file or line on
    ``stderr``, write the figures to ``out`` (default ``RUN_DIR/report``) and print each path on
    ``stdout``. Returns the exit code: 0, or 2 after one error line (not a run directory, no
    metrics, an output folder that cannot be written)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        data = load_run(run_dir)
    except ReportError as e:
        for warning in e.warnings:
            print(f"{PROG}: warning: {warning}", file=stderr)
        print(f"{PROG}: error: {e}", file=stderr)
        return EXIT_REFUSED
    for warning in data.warnings:
        print(f"{PROG}: warning: {warning}", file=stderr)
    target = Path(out) if out is not None else data.run_dir / REPORT_DIRNAME
    try:
        paths = write_report(data, target)
    except OSError as e:
        print(f"{PROG}: error: cannot write the report to {target} ({e.strerror or e}), expected a writable folder",
              file=stderr)
        return EXIT_REFUSED
    for path in paths:
        print(path, file=stdout)
    return EXIT_OK
