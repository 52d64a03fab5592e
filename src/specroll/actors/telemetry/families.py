"""From a role's plain counters to Prometheus metric families, at scrape time.

A role keeps ordinary Python numbers (most of them it keeps anyway: the engine's counters, the
trainer's last record) and a :class:`Buckets` per histogram; nothing on a hot path touches
``prometheus_client``. A scrape (the endpoint's thread) calls the role's ``collect`` function, which
reads those numbers and builds the families with :func:`family` — so a metric the catalogue does not
list cannot be exported, and one exported with the wrong type or labels fails here.

Reads from the scrape thread are of ints, floats and copies of small lists and dicts (atomic under
the GIL); a scrape may see one counter updated and its neighbour not yet, never a torn number.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from specroll.actors.telemetry import catalogue as c
from specroll.actors.telemetry.catalogue import Metric as MetricSpec
from specroll.protocol.wire import ErrorCode

LabelValues = tuple[str, ...]


class Buckets:
    """A histogram's counts, kept by one writer (the role's event loop) and read by scrapes.

    Args:
        bounds: upper bounds, ascending (``+Inf`` is implicit).
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        """Observations per bucket, not cumulative; the last is above every bound."""
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Count ``count`` observations of ``value`` (in the bucket of the first bound >= value).
        NaN is ignored."""
        if value != value:
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` per bound and ``+Inf``, as the text format wants."""
        counts = list(self.counts)
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            total += n
            out.append(("+Inf" if bound == math.inf else _le(bound), float(total)))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


def family(spec: MetricSpec, samples: Iterable[tuple[LabelValues, float | Buckets]]) -> Metric:
    """The family of ``spec`` with one sample per label values.

    Args:
        spec: the catalogue's entry.
        samples: ``(label values, value)``: a number for a counter or gauge (None read as NaN), a
            :class:`Buckets` for a histogram; label values in ``spec.labels``'s order.

    Raises:
        ValueError: a sample's label count or value type does not match ``spec``.
    """
    labels = list(spec.labels)
    match spec.kind:
        case "counter":
            fam: Metric = CounterMetricFamily(spec.name, spec.help, labels=labels)
        case "gauge":
            fam = GaugeMetricFamily(spec.name, spec.help, labels=labels)
        case "histogram":
            fam = HistogramMetricFamily(spec.name, spec.help, labels=labels)
    for values, value in samples:
        if len(values) != len(labels):
            raise ValueError(f"{spec.name}: label values {values!r}, expected {len(labels)} ({', '.join(labels)})")
        if spec.kind == "histogram":
            if not isinstance(value, Buckets):
                raise ValueError(f"{spec.name}: a histogram needs Buckets, got {type(value).__name__}")
            fam.add_metric(list(values), value.cumulative(), value.sum)  # type: ignore[attr-defined]
        else:
            if isinstance(value, Buckets):
                raise ValueError(f"{spec.name}: a {spec.kind} needs a number, got Buckets")
            fam.add_metric(list(values), math.nan if value is None else float(value))  # type: ignore[attr-defined]
    return fam


class CallbackCollector(Collector):
    """A ``prometheus_client`` collector that builds its families by calling ``collect`` at each scrape."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        """The families of one scrape."""
        yield from self._collect()


def role_families(refusals: Counter[str], role: str, actor_id: str) -> Iterator[Metric]:
    """What every role exports: the messages it refused by error code (each code, 0 included), and
    its identity (``specroll:role_info``)."""
    counts = dict(refusals)
    yield family(c.REFUSALS, [((code,), counts.get(code, 0)) for code in get_args(ErrorCode)])
    yield family(c.ROLE_INFO, [((role, actor_id), 1)])
