"""``bench_drafter_curve.py``'s report: the printed tables and the figure, from the JSON-ready results."""

from __future__ import annotations

import textwrap
from pathlib import Path


def _fmt(values: list[float], digits: int = 2) -> str:
    return " ".join(f"{v:.{digits}f}" for v in values)


def print_table(results: list[dict], k: int) -> None:
    """A row per variant and checkpoint: offline estimates on the held-out rollouts."""
    first = results[0]["points"][0]["offline"]
    print(f"held-out, teacher forced ({first['rows']} response positions): target entropy "
          f"{first['target_entropy']:.3f} nats, mean max p {first['target_top1_mass']:.3f}")
    ks = ", ".join(str(j) for j in range(1, k + 1))
    print(f"{'variant':>17} {'CPU-min':>7} {'steps':>5} | est. acceptance k={ks:<{5 * k - 2}} | "
          f"{'1-TV per position':<{6 * k - 1}} | {'KL(p^|q) per position':<{6 * k - 1}} | off-vocab p | top-1 pos 1")
    for entry in results:
        for pt in entry["points"]:
            o = pt["offline"]
            pos = o["positions"]
            print(f"{entry['variant']:>17} {pt['cpu_minutes']:7.2f} {pt['steps']:5d} | "
                  f"{_fmt(o['est_acceptance']):<{17 + 2 * k}} | {_fmt([x['accept_prob'] for x in pos], 3)} | "
                  f"{_fmt([x['kl'] for x in pos], 3)} | {pos[0]['outside_mass']:11.4f} | {pos[0]['top1']:.3f}")


def print_engine(results: list[dict], k: int) -> None:
    """Per engine-measured head: acceptance per arm at B = 1, the offline chain estimate beside the
    engine's, and tokens/s ratios to off."""
    for entry in results:
        for pt in entry["points"]:
            eng = pt["engine"]
            if eng is None:
                continue
            b1 = eng["batch1"]
            print(f"\n{entry['variant']} at {pt['cpu_minutes']:.2f} CPU-min, engine, T=1:")
            print("  acceptance at B=1: " + ", ".join(
                f"{arm} {row['acceptance_length']:.2f}" for arm, row in b1.items() if row["acceptance_length"]))
            est = pt["offline"]["est_acceptance"]
            chains = [b1.get(f"chain:{j}", {}).get("acceptance_length") for j in range(1, k + 1)]
            print(f"  chain k=1..{k}: offline estimate {_fmt(est)} | engine "
                  + " ".join(f"{c:.2f}" if c else "-" for c in chains))
            offline_pos = [est[0] - 1] + [est[j] - est[j - 1] for j in range(1, k)]
            engine_pos = b1.get(f"chain:{k}", {}).get("accept_rate_per_pos", [])
            print(f"  P(draft j accepted), j=1..{k}: offline {_fmt(offline_pos, 3)} | engine chain:{k} "
                  f"{_fmt(engine_pos, 3)}")
            for b, arms in eng["speed"].items():
                print(f"  B={b}: off {arms['off']['tok_s']:.1f} tok/s; " + ", ".join(
                    f"{arm} {row['tok_s']:.1f} tok/s {row['ratio']:.2f}x" for arm, row in arms.items() if arm != "off"))


def merge_reports(reports: list[dict], names: list[str]) -> dict:
    """The variants of several runs' results as one report, each run's date, commit and command kept
    under ``sources``.

    Raises:
        ValueError: a file that is not a results file, a variant held by two files, or files measured
            with different numbers of draft positions.
    """
    variants: list[dict] = []
    sources: list[dict] = []
    seen: dict[str, str] = {}
    ks = set()
    for report, name in zip(reports, names, strict=True):
        if not isinstance(report, dict) or not isinstance(report.get("variants"), list) or "command" not in report:
            raise ValueError(f"{name}: expected a results file written by --json")
        for entry in report["variants"]:
            if entry["variant"] in seen:
                raise ValueError(f"variant {entry['variant']!r} is in both {seen[entry['variant']]} and {name}; "
                                 "expected each variant in one file")
            seen[entry["variant"]] = name
            variants.append(entry)
            ks.update(len(p["offline"]["est_acceptance"]) for p in entry["points"])
        sources.append({key: report.get(key) for key in ("date", "commit", "command", "complete")}
                       | {"file": name, "variants": [e["variant"] for e in report["variants"]]})
    if len(ks) > 1 or not variants:
        raise ValueError(f"{', '.join(names)}: expected variants measured at one number of draft positions, "
                         f"found {sorted(ks) or 'no variants'}")
    return {"date": max(s["date"] for s in sources), "commit": None, "command": None, "sources": sources,
            "variants": variants, "num_draft_tokens": ks.pop(), "data": reports[0].get("data"),
            "complete": all(s["complete"] for s in sources)}


def plot_curve(report: dict, path: Path, k: int) -> None:
    """Estimated acceptance at k and ``1 − TV`` at position 1 against CPU-minutes, a line per
    variant (engine-measured chain acceptance as hollow markers), dated and with the command."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for n, entry in enumerate(report["variants"]):
        color = f"C{n}"
        pts = entry["points"]
        x = [p["cpu_minutes"] for p in pts]
        left.plot(x, [p["offline"]["est_acceptance"][k - 1] for p in pts], "o-", color=color, label=entry["variant"])
        right.plot(x, [p["offline"]["positions"][0]["accept_prob"] for p in pts], "o-", color=color,
                   label=entry["variant"])
        if all("tv_0" in p["train"] for p in pts):  # the last steps' own windows: the gap is overfitting
            right.plot(x, [1 - p["train"]["tv_0"] for p in pts], "--", color=color, alpha=0.6)
        measured = [(p["cpu_minutes"], p["engine"]["batch1"][f"chain:{k}"]["acceptance_length"]) for p in pts
                    if p["engine"] is not None and p["engine"]["batch1"][f"chain:{k}"]["acceptance_length"]]
        if measured:
            left.plot(*zip(*measured, strict=True), "s", mfc="none", color=color, ms=9)
    left.plot([], [], "s", mfc="none", color="gray", ms=9, label=f"engine, chain k={k}, B=1")
    right.plot([], [], "--", color="gray", label="training windows (last steps)")
    left.set(xscale="log", xlabel="training CPU-minutes (both threads)",
             ylabel=f"acceptance length, sampled chain k={k}",
             title=f"Est. acceptance length k={k} (held out, teacher forced)")
    right.set(xscale="log", xlabel="training CPU-minutes (both threads)", ylabel="1 − TV(p, q)",
              title="Acceptance probability of draft 1 (held out)")
    ticks = sorted({p["checkpoint"] for e in report["variants"] for p in e["points"]})
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    sources = report.get("sources") or [report]
    footer = [line for s in sources for line in textwrap.wrap(f"{s['date']}, commit {s['commit']}: {s['command']}",
                                                              width=200, subsequent_indent="    ")]
    fig.text(0.01, 0.01, "\n".join(footer), fontsize=6.5, family="monospace")
    fig.tight_layout(rect=(0, 0.02 + 0.018 * len(footer), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
