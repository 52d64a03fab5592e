"""Off-step pipeline against a synchronous RL loop: trained samples/s on a synthetic long-tail workload.

Both loops run in one process tree, one after the other, against the same generator processes: real
:class:`~specroll.actors.generator.actor.GeneratorActor` processes (``--generators``, real ZeroMQ sockets,
credit, heartbeats, weight fetches) serving a :class:`fake_engine.FakeEngine` that costs ``--step-s``
per step whatever its batch (up to ``--max-num-seqs``) and emits one token per running request, and a
:class:`~specroll.actors.rollout.client.RolloutClient` in this process playing the trainer. Each loop trains
``--steps`` steps of ``--batch-groups`` (B) groups of ``--n`` samples, on the same prompts in the same
order; "training" is a sleep of ``--train-s`` and a publish of a small dummy tensor as the next policy
version.

- **synchronous**: submit B groups, wait until every sample of all of them finished, train, publish,
  wait until every generator acknowledged the new version, repeat;
- **off-step** (specroll's mode, as ``actors/trainer.py`` runs it): a feeder keeps
  ``--max-groups-in-flight`` groups queued, generating or finished-but-untrained; a step starts as soon
  as B groups finished (oldest first; the tail never blocks it), trains, publishes and goes on without
  waiting for acknowledgements. Unfinished samples keep decoding across updates (partial rollouts), so
  one sample's tokens may carry several policy versions.

**Workload.** Prompt p has a median response length ``m_p = median_tokens * exp(sigma_prompt * z_p)``
and its sample i the length ``min(cap, round(m_p * exp(sigma_sample * z_pi)))`` (z standard normal,
seeded by ``--seed`` and p): lognormal with total sigma ``sqrt(sigma_prompt² + sigma_sample²)`` = 1.0
by default, siblings correlated (the prompt part carries 64% of the log-variance), capped at
``cap_factor * median_tokens`` = 20x the median — the shape of reasoning rollouts, where the longest is
~20x the median (see DESIGN.md). The lengths travel in the prompt token ids (``encode_prompt``), so
both loops see exactly the same lengths.

**Defaults, and why.** ``step_s = 0.02``: a memory-bound decode step of a 7-8B model on one GPU at
batch <= 64 (the weights are read once per step, so the cost hardly depends on the batch).
``max_num_seqs = 64`` x 2 generators = 128 decode slots; B x n = 32 x 8 = 256 samples per step, two
per slot, as a synchronous loop sizes its batch to keep the fleet busy (continuous batching inside the
step). ``median_tokens = 32`` keeps the run to ~2 minutes; what matters is the shape, not the scale.
``train_s = 1.5``: about a median group's generation time (~75 tokens, the longest of 8 siblings of a
median prompt, x 0.02 s), which makes rollout ~85% of a synchronous step, as reported for reasoning
RL (65-85%); the off-step loop's generators must produce 256 samples (~13k tokens, ~2 s of 128 full
slots) per step, so it stays generator-bound and generators never wait for the trainer.
``max_groups_in_flight = 2B``: enough queued work that a generator refills its slots as soon as a
group finishes, while bounding how far generation runs ahead of training (staleness).
``stream_every = 8``: fewer, larger chunks keep the messaging cost of ~6k tokens/s small next to
``step_s`` on a 2-core machine; token values and chunk sizes do not affect the comparison.

**Output** (printed, and with ``--json PATH`` written there):

- ``sync_samples_per_s`` / ``async_samples_per_s``: trained samples over the wall time from the first
  submit to the end of the last step (its train and publish, and in sync mode the acknowledgements);
  ``ratio`` = async / sync (target >= 2.0);
- ``sync_tokens_per_s`` / ``async_tokens_per_s`` / ``token_ratio``: the same with trained response
  tokens. Off-step trains groups in the order they finish, so over a short run it trains a
  shorter-than-average mix (the longest groups are still in flight at the end), which flatters its
  samples/s and understates its tokens/s; the two ratios bracket the steady-state gain, and
  ``mean_response_tokens`` of each mode shows the size of the effect;
- ``generator_idle_fraction`` (off-step; target < 0.10): the fraction of the off-step wall time a
  generator's engine had no live request, measured in the fake engine and averaged over generators
  (``sync_generator_idle_fraction`` beside it); ``*_batch_fill``: mean running requests per step over
  ``max_num_seqs`` (the long tail of a synchronous step shows here, not as idle time);
  ``*_decode_fraction``: the fraction of wall time spent inside engine steps;
- ``staleness_histogram``: ``{lag: trained tokens}`` of the off-step loop, lag = the trainer's policy
  version when it trained the token minus the version that produced it (no staleness bound is
  applied here); ``multi_version_sample_fraction``: trained samples whose tokens span several versions;
- ``protocol_errors`` (client side) and ``generator_log_problems`` (WARNING/ERROR lines in the
  generators' logs, printed to stderr): both 0 in a healthy run;
- ``sync`` / ``async``: per-loop detail (trained samples and tokens, wall time of each step);
  ``workload``: the parameters and the measured lengths of the prompts both loops train.

Timing is wall-clock and the machine may be shared: the 1-minute load average before and after is
written with the results. Usage (about 2 minutes on 2 CPU cores)::

    python benchmarks/bench_pipeline.py --json bench_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import Popen
from typing import IO

from fake_engine import Timeline, start_fake_generator, stop_processes
from pipeline_loops import Phase, Settings, Workload, run_off_step, run_sync


def window_metrics(timelines: Sequence[Timeline], start: float, end: float) -> dict[str, float]:
    """Idle fraction, decode fraction and batch fill of the engines in ``[start, end]``, averaged."""
    def overlap(a: float, b: float) -> float:
        return max(0.0, min(b, end) - max(a, start))

    idle, decode, fill = [], [], []
    span = end - start
    for t in timelines:
        idle.append(sum(overlap(a, b) for a, b in t.idle) / span)
        decode.append(sum(overlap(a, b) for a, b, _ in t.steps) / span)
        batches = [batch for a, _, batch in t.steps if start <= a < end]
        fill.append(sum(batches) / (len(batches) * t.max_num_seqs) if batches else 0.0)
    return {"idle_fraction": statistics.fmean(idle), "decode_fraction": statistics.fmean(decode),
            "batch_fill": statistics.fmean(fill)}


async def bench(wl: Workload, s: Settings, workdir: Path, procs: list[Popen[bytes]],
                logs: list[IO[bytes]]) -> tuple[Phase, Phase]:
    """Start the generators, run both loops against them, stop them (they write their timelines)."""
    import anyio

    from specroll.actors.rollout.client import RolloutClient

    async with RolloutClient(max_groups_in_flight=s.max_groups_in_flight, heartbeat_timeout_s=30.0) as client:
        try:
            for i in range(s.generators):
                log = open(workdir / f"generator{i}.log", "wb")  # closed by main
                logs.append(log)
                procs.append(start_fake_generator(client.endpoint, actor_id=f"fake-{i}", step_s=s.step_s,
                                                  max_num_seqs=s.max_num_seqs, stream_every=s.stream_every,
                                                  timeline=str(workdir / f"timeline{i}.json"), log=log))
            await client.wait_for_generators(s.generators, timeout=120.0)
            sync, version = await run_sync(client, wl, s, 0)
            print(f"sync:     {sync.samples} samples in {sync.wall_s:.1f} s "
                  f"(steps {', '.join(f'{x:.1f}' for x in sync.step_s)} s)", flush=True)
            off, version = await run_off_step(client, wl, s, version)
            print(f"off-step: {off.samples} samples in {off.wall_s:.1f} s "
                  f"(steps {', '.join(f'{x:.1f}' for x in off.step_s)} s)", flush=True)
        finally:
            logging.getLogger("specroll.client").setLevel(logging.ERROR)  # not "generator ... is gone" each
            with anyio.CancelScope(shield=True):  # the client keeps serving while they flush and exit
                await anyio.to_thread.run_sync(stop_processes, procs)
        sync.protocol_errors = client.protocol_errors
    return sync, off


def summarize(wl: Workload, s: Settings, sync: Phase, off: Phase, timelines: list[Timeline],
              load: tuple[float, float], log_problems: list[str]) -> dict[str, object]:
    sync_rate, off_rate = sync.samples / sync.wall_s, off.samples / off.wall_s
    sync_tok, off_tok = sync.tokens / sync.wall_s, off.tokens / off.wall_s
    lengths = [x for p in range(s.steps * s.batch_groups) for x in wl.lengths(p)]
    median = statistics.median(lengths)
    result: dict[str, object] = {
        "sync_samples_per_s": sync_rate,
        "async_samples_per_s": off_rate,
        "ratio": off_rate / sync_rate,
        "sync_tokens_per_s": sync_tok,
        "async_tokens_per_s": off_tok,
        "token_ratio": off_tok / sync_tok,
        "generator_idle_fraction": None,
        "staleness_histogram": {str(lag): n for lag, n in sorted(off.staleness.items())},
        "mean_staleness": sum(lag * n for lag, n in off.staleness.items()) / max(1, off.tokens),
        "max_staleness": max(off.staleness, default=0),
        "multi_version_sample_fraction": off.multi_version_samples / max(1, off.samples),
    }
    if len(timelines) == s.generators:
        for name, phase in (("sync", sync), ("async", off)):
            m = window_metrics(timelines, phase.start, phase.end)
            result[f"{name}_generator_idle_fraction"] = m["idle_fraction"]
            result[f"{name}_batch_fill"] = m["batch_fill"]
            result[f"{name}_decode_fraction"] = m["decode_fraction"]
        result["generator_idle_fraction"] = result.pop("async_generator_idle_fraction")
    for phase in (sync, off):
        result[phase.mode] = {"trained_samples": phase.samples, "trained_tokens": phase.tokens,
                              "wall_s": phase.wall_s, "steps": s.steps, "step_wall_s": phase.step_s,
                              "mean_response_tokens": phase.tokens / max(1, phase.samples)}
    result["workload"] = {
        "n": wl.n, "batch_groups": s.batch_groups, "steps": s.steps, "median_tokens": wl.median_tokens,
        "sigma_prompt": wl.sigma_prompt, "sigma_sample": wl.sigma_sample,
        "sigma_total": math.hypot(wl.sigma_prompt, wl.sigma_sample), "cap_tokens": wl.cap, "seed": wl.seed,
        "trained_prompt_lengths": {"median": median, "mean": statistics.fmean(lengths), "max": max(lengths),
                                   "max_over_median": max(lengths) / median},
        "generators": s.generators, "max_num_seqs": s.max_num_seqs, "step_s": s.step_s, "train_s": s.train_s,
        "max_groups_in_flight": s.max_groups_in_flight, "stream_every": s.stream_every,
    }
    result["protocol_errors"] = sync.protocol_errors
    result["generator_log_problems"] = len(log_problems)  # WARNING/ERROR lines (printed to stderr); expected 0
    result["load_average_1m"] = {"before": load[0], "after": load[1]}
    result["command"] = " ".join(["python", *sys.argv])
    return result


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number")
        return value
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_pipeline.py",
                                description="Off-step pipeline vs synchronous RL loop on a long-tail workload.")
    pos_int, pos_float = _positive(int), _positive(float)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--generators", type=pos_int, default=2, help="fake generator processes")
    p.add_argument("--max-num-seqs", type=pos_int, default=64, help="decode slots per generator")
    p.add_argument("--step-s", type=pos_float, default=0.02, help="seconds per engine step, any batch size")
    p.add_argument("--n", type=pos_int, default=8, help="samples per group")
    p.add_argument("--batch-groups", type=pos_int, default=32, help="groups per training step (B)")
    p.add_argument("--steps", type=pos_int, default=6, help="training steps per loop")
    p.add_argument("--train-s", type=pos_float, default=1.5, help="seconds one training step takes")
    p.add_argument("--max-groups-in-flight", type=pos_int, default=None,
                   help="off-step: groups queued + generating + finished-untrained (default: 2 x batch-groups)")
    p.add_argument("--median-tokens", type=pos_int, default=32, help="median response length")
    p.add_argument("--sigma-prompt", type=float, default=0.8, help="log-sd of the per-prompt median")
    p.add_argument("--sigma-sample", type=float, default=0.6, help="log-sd of a sample around its prompt's median")
    p.add_argument("--cap-factor", type=pos_float, default=20.0, help="response length cap, x median")
    p.add_argument("--stream-every", type=pos_int, default=8, help="engine steps between chunks of a sample at most")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    args = p.parse_args(argv)
    if args.max_groups_in_flight is None:
        args.max_groups_in_flight = 2 * args.batch_groups
    if args.max_groups_in_flight < args.batch_groups:
        p.error(f"--max-groups-in-flight {args.max_groups_in_flight} < --batch-groups {args.batch_groups}: "
                "a step could never start")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import anyio

    wl = Workload(args.n, args.median_tokens, args.sigma_prompt, args.sigma_sample, args.cap_factor, args.seed)
    s = Settings(args.generators, args.max_num_seqs, args.step_s, args.stream_every, args.batch_groups, args.steps,
                 args.train_s, args.max_groups_in_flight)
    load_before = os.getloadavg()[0]
    procs: list[Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        workdir = Path(tmp)
        try:
            sync, off = anyio.run(bench, wl, s, workdir, procs, logs, backend="asyncio")
        except BaseException:
            for i, log in enumerate(logs):
                log.flush()
                tail = (workdir / f"generator{i}.log").read_text(errors="replace")[-2000:]
                print(f"--- generator {i} log (tail) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            stop_processes(procs)  # already stopped on the normal path; this covers every other one
            for log in logs:
                log.close()
        timelines = [Timeline.read(t) for t in sorted(workdir.glob("timeline*.json"))]
        problems = [line for t in sorted(workdir.glob("generator*.log"))
                    for line in t.read_text(errors="replace").splitlines() if " WARNING " in line or " ERROR " in line]
    for line in problems[:20]:
        print(f"generator log: {line}", file=sys.stderr)
    result = summarize(wl, s, sync, off, timelines, (load_before, os.getloadavg()[0]), problems)
    if len(timelines) != s.generators:
        print(f"warning: {len(timelines)} of {s.generators} generators wrote a timeline; no idle fraction",
              file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k not in ("sync", "async", "workload")}, indent=1))
    print(f"ratio (off-step / synchronous trained samples/s): {result['ratio']:.2f}x "
          f"(tokens/s: {result['token_ratio']:.2f}x), generator idle fraction (off-step): "
          f"{result['generator_idle_fraction']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
