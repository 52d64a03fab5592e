"""Scraping a launched role's ``/metrics`` as Prometheus would: the role's target file
(``RUN_DIR/metrics/targets/<actor>.json``) names its address; the reply is read with
``prometheus_client``'s own text parser."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from helpers.timeouts import guard
from specroll.actors.telemetry import catalogue

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def target(run_dir: Path, actor: str) -> str | None:
    """The ``host:port`` a role's target file names, or None before it is written."""
    path = run_dir / "metrics" / "targets" / f"{actor}.json"
    try:
        return json.loads(path.read_text())[0]["targets"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def scrape(run_dir: Path, actor: str) -> tuple[dict[str, str], Samples]:
    """(family name → type, sample (name, sorted labels) → value) of one scrape of ``actor``."""
    with urllib.request.urlopen(f"http://{target(run_dir, actor)}/metrics", timeout=guard(30)) as reply:
        text = reply.read().decode()
    types, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def answers(run_dir: Path, actor: str) -> bool:
    """Whether ``actor``'s endpoint answers a scrape now."""
    try:
        scrape(run_dir, actor)
    except OSError:
        return False
    return True


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def assert_catalogue(scraped: tuple[dict[str, str], Samples], *roles: catalogue.Role,
                     speculative: bool = True) -> None:
    """Every metric the catalogue lists for ``roles`` is in the scrape, with its type and a sample
    (the speculative-decoding ones only when ``speculative``, and then none of them otherwise)."""
    types, samples = scraped
    for m in catalogue.of_role(*roles):
        if m.speculative and not speculative:
            assert m.name not in types, m.name
            continue
        assert types.get(m.name) == m.kind, (roles, m.name, types.get(m.name))
        assert any(name.startswith(m.name) for name, _ in samples), (roles, m.name)
