"""``bench_overhead.py --metrics``: what live metrics (``[metrics] enabled``) cost a generator's step loop.

One decode engine of the benchmark's model keeps ``B`` requests running (each asks for
``MAX_TOKENS`` tokens; one that finishes is replaced through ``LiveSamples.submit`` before the next
step, untimed, so the batch stays at ``B``). A timed step is the step loop's work per step, as in
``GeneratorActor._step_loop``: ``engine.step()``, the busy-time and step counters, and the real
``LiveSamples.on_outputs`` (its chunks appended to a list that is cleared). Two arms alternate in
rounds of ``--metrics-round-s`` seconds on that same engine and requests, in the order off, on, on,
off, ... so a drift of the machine or of the context lengths hits both alike:

- **off**: ``LiveSamples(..., latency=None)``, nothing scraped: ``[metrics] enabled = false``;
- **on**: ``latency=RequestLatency()`` (the requests live at the round's start marked admitted
  then), and a real :class:`MetricsEndpoint` scraped over HTTP by a client thread every
  ``--scrape-interval-s`` (default 1 s; Prometheus's default is 15 s, so this is an upper bound),
  the first half an interval into the round. A scrape calls ``collect_generator`` on this engine
  and samples and formats the text in the endpoint's thread, as in a generator; the client is a
  thread of this process too, so its share of the work counts against the loop (an upper bound).

Whole steps: per arm, the median step of the fastest round (the figure ``bench_overhead.py``
reports), the lowest round mean (the mean includes the steps a scrape landed in; the median
ignores them) and the scrapes done. On this shared 2-core machine rounds differ by ~5%, so whole
steps cannot resolve the 1% target; the two parts of the cost are timed on their own:

- **on_outputs**: its median per round (fastest round), off and on: what ``RequestLatency`` adds
  to every step; ``share`` = (on - off) / off step.
- **scrapes**: for each scrape, the time the steps it overlapped took beyond their round's median
  (``stolen``: the GIL held by the scrape's two threads, and the hand-overs: each torch op of the
  step releases the GIL); ``control``: the same over windows of the "off" rounds, where a slow
  step overlaps a window by chance; ``share`` = (stolen - control) / interval. Also a scrape's wall
  time while steps run, alone (engine idle), and ``generate_latest`` in-process.

Check of the method (this 2-core machine): 45 µs of busy wait added to ``RequestLatency.emitted``
(1% of a B = 1 step) read as on/off 0.96 on whole steps, and as a 1.16% share on ``on_outputs``.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from specroll.actors.generator.drafter_swap import DrafterSlot
    from specroll.actors.generator.live_samples import LiveSamples
    from specroll.actors.telemetry.generator_metrics import SyncCounters
    from specroll.engine.engine import Engine
    from specroll.engine.loaders.checkpoint import Checkpoint
    from specroll.protocol.messages import RolloutChunk

MAX_TOKENS = 256
"""Tokens each request asks for: most steps are decodes; the first requests' budgets are spread
over ``(0, MAX_TOKENS]`` so that replacements (a 32-token prefill each) come one at a time."""
PROMPT_LEN = 32
WARMUP_STEPS = 20
"""Steps run, untimed, once the requests are added (the first ones prefill)."""
IDLE_SCRAPES = 20
"""Scrapes timed with the engine idle, for the cost of one scrape alone."""


@dataclass
class _Peer:
    refusals: Counter[str] = field(default_factory=Counter)


@dataclass
class StepLoop:
    """A generator's step loop: what ``collect_generator`` reads of a ``GeneratorActor``, and its step."""

    engine: Engine
    samples: LiveSamples
    drafter: DrafterSlot
    sync: SyncCounters
    prompts: list[list[int]]
    sent: list[RolloutChunk]
    """The chunks' outbox (``LiveSamples.put``), cleared after each step."""
    peer: _Peer = field(default_factory=_Peer)
    num_steps: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    submitted: int = 0

    def refill(self, batch: int) -> None:
        """Submit one-sample groups until ``batch`` samples are live."""
        from specroll.protocol.messages import SubmitGroup
        from specroll.protocol.sampling import SamplingParams

        while len(self.samples.streams) < batch:
            n = self.submitted
            budget = MAX_TOKENS if n >= batch else MAX_TOKENS - n * MAX_TOKENS // batch
            sampling = SamplingParams(temperature=1.0, max_tokens=budget, ignore_eos=True, seed=n)
            self.samples.submit(SubmitGroup(group_id=f"g{n}", prompt_token_ids=self.prompts[n % len(self.prompts)],
                                            n=1, sampling=sampling))
            self.submitted += 1

    def step(self) -> tuple[float, float, float]:
        """One step of the loop (module docstring): ``(start, end, seconds in on_outputs)``, perf_counter."""
        start = time.perf_counter()
        begun = time.monotonic()
        outputs = self.engine.step()
        self.busy_s += time.monotonic() - begun
        self.num_steps += 1
        stepped = time.perf_counter()
        self.samples.on_outputs(outputs)
        end = time.perf_counter()
        self.sent.clear()
        return start, end, end - stepped


class Scraper:
    """A client thread that GETs ``url`` every ``interval_s`` while resumed (the first scrape half an
    interval after :meth:`resume`); :meth:`pause` returns once no scrape is in flight."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.spans: list[tuple[float, float]] = []
        """``(start, end)`` of each scrape, perf_counter seconds, request to the reply's last byte."""
        self._on, self._off, self._busy = threading.Event(), threading.Event(), threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)
        self._thread.start()

    def scrape(self) -> bytes:
        """One scrape; raises on a reply that is not the generator's families."""
        start = time.perf_counter()
        with urllib.request.urlopen(self.url, timeout=10) as reply:
            body = reply.read()
        self.spans.append((start, time.perf_counter()))
        assert b"vllm:num_requests_running" in body and b"vllm:inter_token_latency_seconds_bucket" in body, body[:200]
        return body

    def resume(self) -> None:
        self._off.clear()
        self._on.set()

    def pause(self) -> None:
        """Stop scraping; raises what a scrape in the thread raised."""
        self._on.clear()
        self._off.set()
        with self._busy:
            pass
        if self._error is not None:
            raise RuntimeError(f"a scrape of {self.url} failed") from self._error

    def alive(self) -> bool:
        """The thread runs and no scrape has failed."""
        return self._thread.is_alive() and self._error is None

    def close(self) -> None:
        self._closed = True
        self._on.set()
        self._off.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        while True:
            self._on.wait()
            if self._closed:
                return
            next_at = time.monotonic() + self.interval_s / 2
            while self._on.is_set() and not self._closed:
                delay = next_at - time.monotonic()
                if delay > 0:
                    self._off.wait(delay)
                    continue
                with self._busy:
                    if self._on.is_set() and self._error is None:
                        try:
                            self.scrape()
                        except Exception as e:  # raised again by pause(), in the timing thread
                            self._error = e
                next_at += self.interval_s


@dataclass
class Round:
    """One round's steps ``(start, end, seconds in on_outputs)`` and scrapes ``(start, end)``, perf_counter."""

    start: float
    steps: list[tuple[float, float, float]]
    scrapes: list[tuple[float, float]]

    def median_s(self) -> float:
        return statistics.median(end - start for start, end, _ in self.steps)

    def stolen_s(self, windows: list[tuple[float, float]]) -> list[float]:
        """Per window, what the steps it overlapped took beyond the round's median: the loop's time a
        scrape in it took. Over windows where nothing ran (the control) it is the bias of the estimate:
        a slow step is likelier to overlap a window."""
        median = self.median_s()
        return [sum(max(0.0, end - start - median) for start, end, _ in self.steps if start < w_end and end > w_start)
                for w_start, w_end in windows]

    def summary(self, stolen: list[float]) -> dict[str, object]:
        durations = [end - start for start, end, _ in self.steps]
        return {"median_ms": 1e3 * statistics.median(durations), "mean_ms": 1e3 * statistics.fmean(durations),
                "on_outputs_us": 1e6 * statistics.median(o for _, _, o in self.steps), "steps": len(self.steps),
                "scrapes": len(self.scrapes), "stolen_ms": [1e3 * x for x in stolen]}


def run_round(loop: StepLoop, batch: int, seconds: float, scraper: Scraper | None) -> Round:
    """Steps for ``seconds``, scraped by ``scraper`` if one is given — then on until its first scrape
    of the round has landed (a starved scraper thread must not make a scraped round an unscraped one),
    or its thread failed (:meth:`Scraper.pause` raises that)."""
    if scraper is not None:
        scraper.resume()
    first = len(scraper.spans) if scraper is not None else 0

    def unscraped() -> bool:
        return scraper is not None and len(scraper.spans) == first and scraper.alive()

    start = time.perf_counter()
    steps: list[tuple[float, float, float]] = []
    while time.perf_counter() < start + seconds or unscraped():
        loop.refill(batch)
        steps.append(loop.step())
    if scraper is None:
        return Round(start, steps, [])
    scraper.pause()
    return Round(start, steps, scraper.spans[first:])


def measure_metrics(checkpoint: Checkpoint, args: argparse.Namespace, batch: int) -> dict[str, object]:
    """Both arms at batch ``batch`` (module docstring); the figures as ``--json``'s ``metrics.batch[B]``."""
    import torch
    from prometheus_client import generate_latest

    from specroll.actors.config import RunConfig
    from specroll.actors.config.metrics_section import MetricsConfig
    from specroll.actors.generator.drafter_swap import DrafterSlot
    from specroll.actors.generator.live_samples import LiveSamples
    from specroll.actors.telemetry.endpoint import MetricsEndpoint
    from specroll.actors.telemetry.generator_metrics import RequestLatency, SyncCounters, collect_generator
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine

    config = EngineConfig(model="bench_overhead", device=args.device, dtype=args.dtype, max_num_seqs=batch,
                          kv_cache_memory_gb=0.5, max_model_len=4096)
    engine = Engine(config, checkpoint=checkpoint)
    seeded = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, checkpoint.config.vocab_size, (batch, PROMPT_LEN), generator=seeded)  # [B, P]
    sent: list[RolloutChunk] = []
    drafter = DrafterSlot(engine, None)
    samples = LiveSamples(engine, drafter, sent.append, stream_every=4, speculative=False, latency=None)
    loop = StepLoop(engine, samples, drafter, SyncCounters(), prompts.tolist(), sent)
    latency = RequestLatency()
    for _ in range(WARMUP_STEPS):
        loop.refill(batch)
        loop.step()
    # The collect a generator's endpoint calls; StepLoop has every attribute it reads of the actor.
    endpoint = MetricsEndpoint(RunConfig(run_dir=tempfile.mkdtemp(prefix="bench_metrics_"),
                                         metrics=MetricsConfig(enabled=True, port=0)),
                               "generator", "generator-0",
                               lambda: collect_generator(loop, "bench_overhead", "generator-0"))  # type: ignore[arg-type]
    scraper = Scraper(f"http://127.0.0.1:{endpoint.port}/metrics", args.scrape_interval_s)
    rounds: dict[str, list[Round]] = {"off": [], "on": []}
    try:
        samples.latency = latency
        scrape_bytes = len(scraper.scrape())
        idle_ms = 1e3 * statistics.median(_scrape_s(scraper) for _ in range(IDLE_SCRAPES))
        start = time.perf_counter()
        for _ in range(IDLE_SCRAPES):
            generate_latest(endpoint.registry)
        format_ms = 1e3 * (time.perf_counter() - start) / IDLE_SCRAPES
        scraper.spans.clear()
        for r in range(args.rounds):
            for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
                samples.latency = latency if arm == "on" else None
                now = time.monotonic()
                for request_id in samples.streams if arm == "on" else ():
                    latency.admitted(request_id, now)  # keeps the times of one it knows
                rounds[arm].append(run_round(loop, batch, args.metrics_round_s, scraper if arm == "on" else None))
    finally:
        scraper.close()
        endpoint.close()
    interval = args.scrape_interval_s
    scrape_s = statistics.median(e - s for s, e in scraper.spans) if scraper.spans else 0.0
    # The control: windows as long as a scrape, where the "on" rounds would have had theirs.
    stolen = {"on": [rnd.stolen_s(rnd.scrapes) for rnd in rounds["on"]],
              "off": [rnd.stolen_s([(w, w + scrape_s) for w in _ticks(rnd.start + interval / 2, rnd.steps[-1][1],
                                                                         interval)]) for rnd in rounds["off"]]}
    row: dict[str, object] = {}
    for arm, records in rounds.items():
        summaries = [rnd.summary(s) for rnd, s in zip(records, stolen[arm], strict=True)]
        row[arm] = {"step_ms": min(r["median_ms"] for r in summaries),  # type: ignore[type-var]
                    "mean_ms": min(r["mean_ms"] for r in summaries),  # type: ignore[type-var]
                    "on_outputs_us": min(r["on_outputs_us"] for r in summaries),  # type: ignore[type-var]
                    "scrapes": sum(len(rnd.scrapes) for rnd in records), "rounds": summaries}
    off, on = row["off"], row["on"]
    stolen_on, stolen_off = ([1e3 * x for per_round in stolen[arm] for x in per_round] for arm in ("on", "off"))
    row["on_over_off"] = on["step_ms"] / off["step_ms"]  # type: ignore[index]
    row["on_over_off_mean"] = on["mean_ms"] / off["mean_ms"]  # type: ignore[index]
    # What RequestLatency adds to a step, over the step: microseconds, timed around on_outputs alone.
    row["latency_share"] = (on["on_outputs_us"] - off["on_outputs_us"]) / (1e3 * off["step_ms"])  # type: ignore[index]
    row["scrape_ms_running"] = 1e3 * scrape_s if scraper.spans else None
    scrape_stolen = statistics.median(stolen_on) if stolen_on else None
    control_stolen = statistics.median(stolen_off) if stolen_off else 0.0
    row["scrape_stolen_ms"], row["control_stolen_ms"] = scrape_stolen, control_stolen
    row["scrape_share"] = None if scrape_stolen is None else max(0.0, scrape_stolen - control_stolen) / (1e3 * interval)
    row["scrape_ms_idle"] = idle_ms
    row["generate_latest_ms"] = format_ms
    row["scrape_bytes"] = scrape_bytes
    return row


def _ticks(first: float, end: float, step: float) -> list[float]:
    """``first``, ``first + step``, ... before ``end``."""
    return [first + i * step for i in range(max(0, int((end - first) // step) + 1)) if first + i * step < end]


def _scrape_s(scraper: Scraper) -> float:
    scraper.scrape()
    start, end = scraper.spans[-1]
    return end - start


def print_metrics(results: dict[str, dict[str, object]], interval_s: float) -> None:
    """The metrics section of the report: whole steps, then the two parts of the cost."""
    print(f"\nlive metrics: engine.step + LiveSamples.on_outputs (decode), off vs on (RequestLatency, /metrics "
          f"scraped every {interval_s:g} s)")
    print(f"{'B':>3} {'off ms':>8} {'on ms':>8} {'on/off':>7} | {'mean off':>8} {'mean on':>8} {'on/off':>7} | "
          f"scrapes off / on   (median step of the fastest round | lowest round mean)")
    for batch, row in results.items():
        off, on = row["off"], row["on"]
        print(f"{batch:>3} {off['step_ms']:>8.3f} {on['step_ms']:>8.3f} {row['on_over_off']:>7.4f} | "  # type: ignore[index]
              f"{off['mean_ms']:>8.3f} {on['mean_ms']:>8.3f} {row['on_over_off_mean']:>7.4f} | "  # type: ignore[index]
              f"{off['scrapes']} / {on['scrapes']}")  # type: ignore[index]
    print(f"{'B':>3} {'on_outputs us off':>17} {'on':>6} {'share':>7} | {'stolen ms':>9} {'control':>7} {'share':>7} | "
          f"{'scrape ms':>9} {'alone':>6} {'format':>6} | {'sum':>7}")
    for batch, row in results.items():
        off, on = row["off"], row["on"]
        share = row["scrape_share"]
        total = row["latency_share"] + (share or 0.0)  # type: ignore[operator]
        print(f"{batch:>3} {off['on_outputs_us']:>17.1f} {on['on_outputs_us']:>6.1f} {row['latency_share']:>7.3%} | "  # type: ignore[index]
              f"{_opt(row['scrape_stolen_ms'], '.2f'):>9} {_opt(row['control_stolen_ms'], '.2f'):>7} "
              f"{_opt(share, '.3%'):>7} | {_opt(row['scrape_ms_running'], '.2f'):>9} "
              f"{row['scrape_ms_idle']:>6.2f} {row['generate_latest_ms']:>6.2f} | {total:>7.3%}")
    print("(on_outputs: median in the fastest round, share: on - off over the off step. stolen: median over scrapes "
          "of the time the steps a scrape overlapped took beyond their round's median, control: the same over "
          "windows of the off rounds, share: (stolen - control) / interval. scrape ms: a scrape's wall time while "
          "steps run, alone: engine idle, format: generate_latest in-process. sum: both shares)")


def _opt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)
