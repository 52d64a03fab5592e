"""``examples/grafana_dashboard.json`` stays honest: it imports into any Grafana (a Prometheus
data-source input), every panel has a title and a query, and every metric and label its queries name
is one a scrape of a specroll role shows (``actors/telemetry/catalogue.py``, prometheus_client's
process metrics, the scrape target's labels) — so renaming or retyping a metric breaks this test
rather than leaving a dashboard panel silently empty; and every query keeps to the runs the ``run``
variable picks (one Prometheus may scrape several runs)."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import ProcessCollector

from specroll.actors.telemetry import catalogue

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana_dashboard.json"
DATASOURCE = "${DS_PROMETHEUS}"

METRIC_NAME = re.compile(r"(?:vllm|specroll):[a-zA-Z0-9_:]+|process_[a-z_]+")
RATE_OF = re.compile(r"\b(?:rate|irate|increase)\(\s*$")
"""Just before a metric name: the name is the range vector of one of these functions."""
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")

TARGET_LABELS = ("run", "role", "actor")
"""The labels of each role's file_sd target (``RUN_DIR/metrics/targets/<actor>.json``)."""
RUN_MATCHER = re.compile(r'(?:^|,)\s*run\s*=~\s*"\$run"\s*(?:,|$)')
"""The matcher that keeps a selector to the runs the ``run`` variable picks (one Prometheus may scrape several)."""
PROMETHEUS_LABELS = ("instance", "job")
"""Labels Prometheus adds to every scraped series."""

REQUIRED = (
    "vllm:generation_tokens_total",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "specroll:token_staleness_bucket",
    "specroll:logprob_diff_mean",
    "specroll:reward_mean",
    "specroll:eval_accuracy",
    "specroll:logprob_mismatch_tokens",
    "specroll:server_requests_total",
)
"""A metric of each group the dashboard is for: throughput, batch, KV cache, acceptance per position,
staleness, training-inference mismatch (and the tokens it was measured on: 0 → NaN, not 0), reward, eval
accuracy, the OpenAI-compatible server."""


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels a collapsed row holds."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(where, expr, legendFormat)`` of every panel target and of every query template variable."""
    found = [(f"panel {p.get('title')!r}", t.get("expr", ""), t.get("legendFormat", ""))
             for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            found.append((f"variable {var['name']!r}", query["query"] if isinstance(query, dict) else query, ""))
    return found


def _scraped_kinds() -> dict[str, str]:
    """Every series name a scrape of some specroll role shows → its kind: a catalogue counter as
    ``name_total``, a histogram as ``_bucket``/``_sum``/``_count`` (its bare name selects nothing), a
    gauge as itself; and the process metrics prometheus_client's ``ProcessCollector`` exports here."""
    kinds: dict[str, str] = {}
    for m in catalogue.ALL:
        if m.kind == "histogram":
            kinds.update({f"{m.name}{suffix}": "histogram" for suffix in ("_bucket", "_sum", "_count")})
        else:
            kinds[m.exposed] = m.kind
    for family in ProcessCollector(registry=None).collect():
        kinds.update({sample.name: family.type for sample in family.samples})
    return kinds


def _series_labels() -> dict[str, set[str]]:
    """Every series name a scrape shows → the label names its own samples carry (``le`` on a histogram's
    ``_bucket``), before the target's and Prometheus's are added."""
    labels: dict[str, set[str]] = {}
    for m in catalogue.ALL:
        if m.kind == "histogram":
            labels.update({f"{m.name}_sum": set(m.labels), f"{m.name}_count": set(m.labels),
                           f"{m.name}_bucket": {*m.labels, "le"}})
        else:
            labels[m.exposed] = set(m.labels)
    for family in ProcessCollector(registry=None).collect():
        labels.update({sample.name: set(sample.labels) for sample in family.samples})
    return labels


def _named_labels(expr: str, legend: str) -> list[str]:
    """The label names an expr groups, matches or joins on, and its legend shows."""
    named = [n.strip() for group in GROUPING.findall(expr) for n in group.split(",")]
    named += [n for body in MATCHERS.findall(expr) for n in MATCHER_LABEL.findall(body)]
    named += LEGEND_LABEL.findall(legend)
    return [n for n in named if n]


def _known_labels() -> set[str]:
    """Label names some scraped series carries: the catalogue's, ``le``, the target's, Prometheus's, and
    ``exported_<name>`` where a metric's own label collides with a target label (honor_labels: false)."""
    own = {label for m in catalogue.ALL for label in m.labels}
    return own | {"le", *TARGET_LABELS, *PROMETHEUS_LABELS} | {f"exported_{n}" for n in own & set(TARGET_LABELS)}


def test_the_dashboard_imports_into_any_grafana_with_a_prometheus_input() -> None:
    dashboard = _dashboard()
    inputs = {i["name"]: i for i in dashboard.get("__inputs", [])}
    assert "DS_PROMETHEUS" in inputs, f"no DS_PROMETHEUS data-source input, only {sorted(inputs)}"
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    assert dashboard["title"] == "specroll run" and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["id"] is None  # a new dashboard on import
    wrong = [(p.get("title"), ds) for p in _panels(dashboard["panels"]) for t in [p, *p.get("targets", [])]
             if p["type"] != "row" and (ds := t.get("datasource", {}).get("uid")) != DATASOURCE]
    assert not wrong, f"panels or targets not on {DATASOURCE} (so not re-pointed on import): {wrong}"


def test_every_panel_has_a_title_a_query_and_an_id_of_its_own() -> None:
    panels = list(_panels(_dashboard()["panels"]))
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(i for i in set(ids) if ids.count(i) > 1)}"
    for panel in panels:
        assert panel.get("title", "").strip(), f"panel {panel['id']} has no title"
        if panel["type"] != "row":
            exprs = [t.get("expr", "").strip() for t in panel.get("targets", [])]
            assert exprs and all(exprs), f"panel {panel['title']!r}: a target without a PromQL expr: {exprs}"


def test_every_metric_a_query_names_is_one_a_scrape_shows() -> None:
    kinds = _scraped_kinds()
    unknown = [(where, name, difflib.get_close_matches(name, kinds, n=1))
               for where, expr, _ in _queries(_dashboard()) for name in METRIC_NAME.findall(expr)
               if name not in kinds]
    assert not unknown, ("metrics no scrape shows — (where, name, nearest exposed name); a counter is "
                         f"exposed as name_total, a histogram as name_bucket/_sum/_count: {unknown}")


def test_counters_and_histograms_are_read_through_rate_and_gauges_never() -> None:
    kinds = _scraped_kinds()
    wrong = []
    for where, expr, _ in _queries(_dashboard()):
        for match in METRIC_NAME.finditer(expr):
            kind = kinds.get(match.group())
            through_rate = RATE_OF.search(expr[:match.start()]) is not None
            if kind is not None and (kind in ("counter", "histogram")) != through_rate:
                wrong.append((where, match.group(), kind))
    assert not wrong, f"counters/histograms outside rate()/increase(), or gauges inside: {wrong}"


def test_every_label_a_query_or_legend_names_is_one_a_series_carries() -> None:
    known = _known_labels()
    unknown = [(where, n) for where, expr, legend in _queries(_dashboard()) for n in _named_labels(expr, legend)
               if n not in known]
    assert not unknown, f"labels no scraped series carries (known: {sorted(known)}): {unknown}"


def test_every_label_a_query_names_is_one_of_the_metrics_it_reads() -> None:
    """Per query: a label it groups by, matches, joins on or shows must be on one of the series it reads
    (their own labels, the target's, Prometheus's) — ``by (role)`` over ``specroll:restarts_total``,
    whose own label is ``process``, would sum every restart into one unlabelled series."""
    own = _series_labels()
    assert "process" in own["specroll:restarts_total"], own["specroll:restarts_total"]
    wrong = []
    for where, expr, legend in _queries(_dashboard()):
        read = {n for name in METRIC_NAME.findall(expr) for n in own.get(name, ())}
        carried = read | {*TARGET_LABELS, *PROMETHEUS_LABELS} | {f"exported_{n}" for n in read & set(TARGET_LABELS)}
        wrong += [(where, expr, n) for n in _named_labels(expr, legend) if n not in carried]
    assert not wrong, f"labels none of the query's metrics carries (where, expr, label): {wrong}"


def test_every_metric_selector_filters_on_the_run_variable() -> None:
    """One Prometheus may scrape several runs (each target carries ``run``): every selector of every query
    — but the ``run`` variable's own — keeps to the runs picked, so no panel mixes in (or sums over) a run
    nobody picked."""
    unfiltered = []
    for where, expr, _ in _queries(_dashboard()):
        if where == "variable 'run'":
            continue
        for match in METRIC_NAME.finditer(expr):
            body = re.match(r"\{([^}]*)\}", expr[match.end():])
            if body is None or not RUN_MATCHER.search(body.group(1)):
                unfiltered.append((where, match.group()))
    assert not unfiltered, f'selectors without run=~"$run" (where, metric): {unfiltered}'
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    run = variables.get("run")
    assert run is not None and run["multi"] and run["includeAll"], "no multi-select run variable with All"
    assert "label_values(specroll:role_info, run)" in json.dumps(run["query"]), run["query"]
    names = list(variables)
    assert names.index("run") < names.index("actor"), f"run must come before actor (it filters it): {names}"


def test_the_panels_cover_what_a_run_is_watched_for() -> None:
    named = {name for _, expr, _ in _queries(_dashboard()) for name in METRIC_NAME.findall(expr)}
    missing = [name for name in REQUIRED if name not in named]
    assert not missing, f"no panel queries {missing}"
