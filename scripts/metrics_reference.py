"""Write the metric tables of ``docs/metrics.md`` from the catalogue (``actors/telemetry/catalogue.py``):
one table per role, a row per metric (the name a scrape shows, its type, labels and meaning), between
the page's ``<!-- metrics:begin -->`` and ``<!-- metrics:end -->`` lines; the rest of the page is prose.

    python scripts/metrics_reference.py           # rewrite the tables
    python scripts/metrics_reference.py --check   # exit 1 if the committed tables are stale

``tests/test_docs.py`` fails when the committed tables differ from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from specroll.actors.telemetry import catalogue as c

PAGE = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
BEGIN, END = "<!-- metrics:begin -->", "<!-- metrics:end -->"

SECTIONS: list[tuple[str, Callable[[c.Metric], bool]]] = [
    ("Generators: vLLM's names", lambda m: m.role == "generator" and m.vllm),
    ("Generators: specroll's", lambda m: m.role == "generator" and not m.vllm),
    ("Trainer", lambda m: m.role == "trainer"),
    ("Trainer and `specroll serve` (the hub)", lambda m: m.role == "hub"),
    ("OpenAI-compatible server (`specroll serve`, or the trainer when it serves)", lambda m: m.role == "server"),
    ("Drafter trainer", lambda m: m.role == "drafter"),
    ("Every role", lambda m: m.role == "any"),
]


def tables() -> str:
    """The tables, as Markdown."""
    out = []
    for title, belongs in SECTIONS:
        out += [f"### {title}", "", "| metric | type | labels | meaning |", "|---|---|---|---|"]
        for m in c.ALL:
            if belongs(m):
                labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
                only = " Only when the generator speculates." if m.speculative else ""
                out.append(f"| `{m.exposed}` | {m.kind} | {labels} | {m.help}{only} |")
        out.append("")
    return "\n".join(out)


def render(page: str) -> str:
    """``page`` with its tables replaced by :func:`tables`.

    Raises:
        ValueError: the page lacks the markers.
    """
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{PAGE}: expected the lines {BEGIN} and {END} around the tables")
    return f"{head}{BEGIN}\n\n{tables()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed tables differ; write nothing")
    args = parser.parse_args(argv)
    page = PAGE.read_text(encoding="utf-8")
    new = render(page)
    if args.check:
        if new != page:
            print(f"{PAGE} is stale: run python scripts/metrics_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
