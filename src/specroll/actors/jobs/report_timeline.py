"""``timeline.png`` of ``specroll report``: the run over wall time from ``RUN_DIR/timeline.jsonl``.

x is seconds since the first event. One row per generator: its live batch (a step plot, one point
per heartbeat) under its capacity (dashed), with a mark where it acknowledged a policy version
(``policy_served``) or swapped a drafter version in (``drafter_served``). One row for the trainer:
its phases as coloured bars (train / wait / publish / eval_wait / checkpoint). Versions published
(``policy_published``, ``drafter_published``) are dotted lines through every row.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from specroll.actors.jobs.report_data import PHASES, Arrival, ArrivalKind, RunData

PHASE_COLORS = {"train": "tab:green", "wait": "0.75", "publish": "tab:blue", "eval_wait": "tab:orange",
                "checkpoint": "tab:brown"}
MARKS: dict[ArrivalKind, tuple[str, str]] = {  # kind → (colour, line style)
    "policy_published": ("tab:red", ":"),
    "policy_served": ("tab:red", "-"),
    "drafter_published": ("tab:purple", ":"),
    "drafter_served": ("tab:purple", "-"),
}
LABEL_GAP = 0.02
"""A published version is labelled with its number when at least this fraction of the x range after
the last labelled one of its kind (closer ones keep their mark, unlabelled)."""


def note(ax: Axes, text: str) -> None:
    """Write ``text`` in the middle of an empty axes."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="0.35")
    ax.set_xticks([])
    ax.set_yticks([])


def _marks(ax: Axes, arrivals: list[Arrival], t0: float) -> None:
    for a in arrivals:
        color, style = MARKS[a.kind]
        ax.axvline(a.t - t0, color=color, linestyle=style, linewidth=1.0 if a.actor is None else 1.4, alpha=0.8)


def _labelled(published: list[Arrival], t0: float, gap: float) -> list[Arrival]:
    """The published versions to label: per kind, each at least ``gap`` seconds after the last labelled."""
    last: dict[ArrivalKind, float] = {}
    keep = []
    for a in sorted(published, key=lambda a: a.t):
        if a.t - t0 - last.get(a.kind, -gap) >= gap:
            keep.append(a)
            last[a.kind] = a.t - t0
    return keep


def _generator_row(ax: Axes, data: RunData, actor: str, t0: float) -> None:
    points = [p for p in data.loads if p.actor == actor]
    if points:
        x = [p.t - t0 for p in points]
        ax.step(x, [p.live for p in points], where="post", color="tab:cyan", linewidth=1.2)
        ax.fill_between(x, [p.live for p in points], step="post", color="tab:cyan", alpha=0.3)
        capacity = [(xi, p.capacity) for xi, p in zip(x, points, strict=True) if p.capacity is not None]
        if capacity:
            ax.step([c[0] for c in capacity], [c[1] for c in capacity], where="post", color="0.4",
                    linestyle="--", linewidth=0.9)
    else:
        ax.text(0.01, 0.5, "no heartbeats recorded", transform=ax.transAxes, va="center", color="0.35")
    _marks(ax, [a for a in data.arrivals if a.actor == actor], t0)
    ax.set_ylabel(f"{actor}\nlive seqs", fontsize=8)
    ax.set_ylim(bottom=0)


def _trainer_row(ax: Axes, data: RunData, t0: float) -> None:
    for phase in PHASES:
        spans = [(s.start - t0, max(s.end - s.start, 0.0)) for s in data.phases if s.phase == phase]
        if spans:
            ax.broken_barh(spans, (0.15, 0.7), facecolors=PHASE_COLORS[phase])
    if not data.phases:
        ax.text(0.01, 0.5, "no trainer phases recorded", transform=ax.transAxes, va="center", color="0.35")
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel("trainer", fontsize=8)


def draw_timeline(data: RunData) -> Figure:
    """The timeline figure (module docstring); a figure with a note when the run has no timeline."""
    t0 = data.t0
    if t0 is None:
        fig = Figure(figsize=(10, 3))
        why = "no timeline.jsonl in this run" if not data.has_timeline else "timeline.jsonl holds no events"
        note(fig.add_subplot(), why)
        fig.suptitle(f"{data.run_dir.name}: timeline")
        return fig
    actors = sorted({p.actor for p in data.loads} | {a.actor for a in data.arrivals if a.actor is not None})
    rows = len(actors) + 1
    fig = Figure(figsize=(12, 1.0 + 1.3 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax, actor in zip(axes, actors, strict=False):
        _generator_row(ax, data, actor, t0)
    _trainer_row(axes[-1], data, t0)
    published = [a for a in data.arrivals if a.actor is None]
    for ax in axes:
        _marks(ax, published, t0)
    lo, hi = axes[-1].get_xlim()
    for a in _labelled(published, t0, LABEL_GAP * (hi - lo)):
        prefix = "p" if a.kind == "policy_published" else "d"
        axes[0].annotate(f"{prefix}{a.version if a.version is not None else '?'}", (a.t - t0, 1.0),
                         xycoords=("data", "axes fraction"), fontsize=7, color=MARKS[a.kind][0],
                         ha="center", va="bottom")
    axes[-1].set_xlabel("seconds since the first event")
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in PHASES]
    handles += [Line2D([], [], color="tab:cyan", label="live batch"),
                Line2D([], [], color="0.4", linestyle="--", label="capacity")]
    handles += [Line2D([], [], color=c, linestyle=s, label=k.replace("_", " ")) for k, (c, s) in MARKS.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=8)
    fig.suptitle(f"{data.run_dir.name}: timeline (p = policy, d = drafter version published)")
    return fig
