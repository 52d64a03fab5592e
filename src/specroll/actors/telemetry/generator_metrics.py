"""A generator's metrics: vLLM's engine metrics under vLLM's names, and specroll's (versions served,
weight syncs, pauses, the step loop's time).

The engine keeps most counters anyway (scheduler, block manager, speculative stats; the actor's
steps and busy/idle seconds); they are read at scrape time. What only the step loop sees — when a
request was admitted, when each of its steps emitted tokens, why it finished — is kept by
:class:`RequestLatency` (a few dict operations per request per step), and weight syncs by
:class:`SyncCounters`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import Metric

from specroll.actors.telemetry import catalogue as c
from specroll.actors.telemetry.families import Buckets, family, role_families

if TYPE_CHECKING:
    from specroll.engine.engine import Engine


class RequestLatency:
    """Time to first token, inter-token latency and end-to-end latency of a generator's requests
    (vLLM's histograms), and its finished requests by reason.

    Times are taken with ``time.monotonic()`` by the caller: when the request is added to the engine
    and at the end of each engine step that emitted its tokens (vLLM stamps the engine core's step
    the same way, ``vllm/v1/metrics/stats.py``).
    """

    def __init__(self) -> None:
        self.ttft = Buckets(c.TTFT.buckets)
        self.itl = Buckets(c.ITL.buckets)
        self.e2e = Buckets(c.E2E.buckets)
        self.finished: Counter[str] = Counter()
        """Finished requests by reason (``stop``, ``length``, ``abort``)."""
        self._times: dict[str, tuple[float, float]] = {}
        """request id → (admitted, last step that emitted; NaN before its first token)."""

    def admitted(self, request_id: str, now: float) -> None:
        """The request entered the engine at ``now`` (a re-prefill of a live request keeps its times)."""
        self._times.setdefault(request_id, (now, math.nan))

    def forget(self, request_id: str) -> None:
        """The request was taken back before it ran (a group refused whole)."""
        self._times.pop(request_id, None)

    def emitted(self, request_id: str, now: float) -> None:
        """A step ending at ``now`` emitted tokens of the request: its first (TTFT) or one more (ITL)."""
        times = self._times.get(request_id)
        if times is None:
            return
        admitted, last = times
        if last != last:
            self.ttft.observe(now - admitted)
        else:
            self.itl.observe(now - last)
        self._times[request_id] = (admitted, now)

    def finished_now(self, request_id: str, reason: str, now: float) -> None:
        """The request finished at ``now`` for ``reason``."""
        times = self._times.pop(request_id, None)
        self.finished[reason] += 1
        if times is not None:
            self.e2e.observe(now - times[0])


@dataclass
class SyncCounters:
    """Policy versions a generator applied: how many, their bytes and seconds, and its pauses."""

    syncs: int = 0
    seconds: float = 0.0
    """From starting each version's fetch to serving it."""
    bytes: int = 0
    pause_s: float = 0.0
    """Decoding stopped to apply policy and drafter versions."""

    def applied(self, nbytes: int, fetch_started: float, pause_s: float) -> None:
        """A version of ``nbytes`` whose fetch started at ``fetch_started`` (monotonic seconds) is
        served now, after ``pause_s`` seconds with decoding stopped."""
        self.syncs += 1
        self.bytes += nbytes
        self.pause_s += pause_s
        self.seconds += max(0.0, time.monotonic() - fetch_started)


class _Samples(Protocol):
    num_tokens: int
    latency: RequestLatency | None
    speculative: bool


class _Versioned(Protocol):
    version: int


class _Peer(Protocol):
    refusals: Counter[str]


class GeneratorState(Protocol):
    """What a scrape reads of a generator (``GeneratorActor`` has it): its engine, its live samples'
    counters, its weight syncs, the drafter version served, its peer connection's refusals and its
    step loop's counters."""

    engine: Engine
    samples: _Samples
    sync: SyncCounters
    drafter: _Versioned
    peer: _Peer
    num_steps: int
    busy_s: float
    idle_s: float


def collect_generator(actor: GeneratorState, model_name: str, actor_id: str) -> Iterator[Metric]:
    """The generator's families at one scrape (the catalogue's ``generator`` and ``any`` metrics)."""
    engine = actor.engine
    sched, blocks = engine.scheduler, engine.block_manager
    v = (model_name, "0")
    prefix = blocks.prefix_counters
    latency = actor.samples.latency
    sync = actor.sync
    speculative = actor.samples.speculative
    spec = engine.spec_stats
    yield family(c.RUNNING, [(v, len(sched.running))])
    yield family(c.WAITING, [(v, len(sched.waiting))])
    yield family(c.KV_USAGE, [(v, 1.0 - blocks.num_free_pages / blocks.num_pages)])
    yield family(c.PREEMPTIONS, [(v, sched.num_preemptions)])
    yield family(c.PREFIX_QUERIES, [(v, prefix.prompt_tokens if blocks.enable_prefix_caching else 0)])
    yield family(c.PREFIX_HITS, [(v, prefix.cached_prompt_tokens)])
    yield family(c.PROMPT_TOKENS, [(v, prefix.prompt_tokens)])
    yield family(c.GENERATION_TOKENS, [(v, actor.samples.num_tokens)])
    finished = dict(latency.finished) if latency is not None else {}
    yield family(c.REQUEST_SUCCESS, [((*v, reason), finished.get(reason, 0)) for reason in ("stop", "length", "abort")])
    if latency is not None:
        yield family(c.TTFT, [(v, latency.ttft)])
        yield family(c.ITL, [(v, latency.itl)])
        yield family(c.E2E, [(v, latency.e2e)])
    if speculative:
        yield family(c.SPEC_DRAFTS, [(v, spec.num_draft_steps)])
        yield family(c.SPEC_DRAFT_TOKENS, [(v, spec.num_drafted)])
        yield family(c.SPEC_ACCEPTED, [(v, spec.num_accepted)])
        per_pos = list(spec.accepted_per_pos)
        k = max(len(per_pos), engine.config.num_draft_tokens)
        yield family(c.SPEC_ACCEPTED_PER_POS, [((*v, str(pos)), per_pos[pos] if pos < len(per_pos) else 0)
                                               for pos in range(k)])
    yield family(c.POLICY_VERSION, [(v, engine.weight_version)])
    yield family(c.DRAFTER_VERSION, [(v, actor.drafter.version)])
    yield family(c.WEIGHT_SYNCS, [(v, sync.syncs)])
    yield family(c.WEIGHT_SYNC_SECONDS, [(v, sync.seconds)])
    yield family(c.WEIGHT_SYNC_BYTES, [(v, sync.bytes)])
    yield family(c.PAUSE_SECONDS, [(v, sync.pause_s)])
    yield family(c.ENGINE_STEPS, [(v, actor.num_steps)])
    yield family(c.BUSY_SECONDS, [(v, actor.busy_s)])
    yield family(c.IDLE_SECONDS, [(v, actor.idle_s)])
    yield from role_families(actor.peer.refusals, "generator", actor_id)

