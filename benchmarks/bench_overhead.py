"""Host overhead of an engine step: a model whose matmuls cost almost nothing, so the step is overhead.

The model has the default model's depth (30 decoder layers, as SmolLM2-135M) but a tiny width
(hidden 64, 4 query heads of 16, 1 KV head, MLP 128, vocabulary 1024 by default): every op the
engine runs per layer and per step is still there — and launched, scheduled and planned as for
the real model — while the arithmetic is negligible. What a step costs is then what the engine
spends around the arithmetic: Python scheduling, building the batch's metadata, planning
attention, dispatching ~30 small ops per layer, sampling and emitting.

For each batch size ``B`` (``--batch-sizes``, default 1, 16, 64) two engines run on the same
prompts, timed alternately in rounds (``--rounds``) so a drift of the machine hits both alike:

- **decode**: ``B`` requests decode one token per step (temperature 1, the rollout case);
- **verify**: the same, with a proposer that drafts ``k`` (``--k``, default 4) tokens for every
  sequence each step, so each step is a ``k + 1``-token verify per sequence. The drafts are
  tokens the model rarely picks (the proposer is a stand-in: the step's cost, not its yield, is
  measured), so the context grows by about one token a step in both modes.

It prints the step time of each — the median step of the fastest round: on a shared 2-core
machine another process stalls whole stretches of steps, and the fastest round is the one least
disturbed — the per-phase breakdown of that round (``engine/phases.py``: schedule, propose,
metadata, forward, sample/verify, emit; means per step) and the ratio verify / decode. On a CUDA
device (``--device cuda``) the phase timer synchronises at each boundary, so there the phases come
from one extra round and the step times from rounds without it.

``--metrics`` adds a section after those: the generator's step loop (a decode step and
``LiveSamples.on_outputs``) with live metrics off and on, a real ``/metrics`` scraped every
``--scrape-interval-s`` in the "on" arm (``metrics_overhead.py``), under ``--json``'s ``metrics`` key.

Usage::

    python benchmarks/bench_overhead.py --json bench_overhead.json
    python benchmarks/bench_overhead.py --batch-sizes 1,16 --metrics --json bench_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common import int_list
from metrics_overhead import measure_metrics, print_metrics

from specroll.actors.shared.arg_types import positive_float, positive_int

if TYPE_CHECKING:

    from specroll.engine.engine import Engine
    from specroll.engine.loaders.checkpoint import Checkpoint
    from specroll.engine.spec.proposer import DraftInput, Proposal

PROMPT_LEN = 32
"""Prompt tokens per request: a few pages, so attention reads a short, realistic page table."""
WARMUP_STEPS = 3
"""Steps run, untimed, after every prompt is prefilled."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Per-step host overhead of decode and k-token verify steps, "
                                            "on a 30-layer model of negligible width.")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 16, 64],
                   help="comma-separated batch sizes (default: 1,16,64)")
    p.add_argument("--steps", type=positive_int, default=40, help="timed steps per round (default: %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="decode/verify rounds, alternated (default: %(default)s)")
    p.add_argument("--k", type=positive_int, default=4,
                   help="drafts per sequence in verify steps (default: %(default)s)")
    p.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary size (default: %(default)s)")
    p.add_argument("--layers", type=positive_int, default=30, help="decoder layers (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights and KV cache (default: %(default)s: on a CPU, torch's bf16 matmul costs "
                        "~20 us a call at this width, a fixed dispatch cost that would swamp the rest)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    p.add_argument("--metrics", action="store_true",
                   help="also time the generator's step loop with live metrics off and on (metrics_overhead.py)")
    p.add_argument("--scrape-interval-s", type=positive_float, default=1.0,
                   help="--metrics: seconds between scrapes of /metrics in the 'on' arm (default: %(default)s; "
                        "Prometheus's default is 15)")
    p.add_argument("--metrics-round-s", type=positive_float, default=3.0,
                   help="--metrics: seconds each off or on round runs, --rounds of each (default: %(default)s)")
    args = p.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: no directory {args.json.parent}")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r}: expected a torch device such as cpu, cuda or cuda:1")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r}: expected cpu or cuda")
    return args


def tiny_deep_checkpoint(vocab: int, layers: int) -> Checkpoint:
    """The benchmark's model: random weights, ``layers`` decoder layers of width 64."""
    import torch
    from tiny_model import write_tiny_tokenizer

    from specroll.engine.loaders.checkpoint import Checkpoint
    from specroll.engine.loaders.tokenizer import Tokenizer
    from specroll.engine.model_config import ModelConfig, expected_weight_shapes

    config = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_layers=layers, num_heads=4, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_ids=(2,))
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.2
               for name, shape in expected_weight_shapes(config).items()}
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_tokenizer(Path(tmp))
        tokenizer = Tokenizer.from_hf_dir(tmp)
    return Checkpoint(config, weights, tokenizer, "bench_overhead")


class RareDrafts:
    """Drafts ``k`` fixed tokens for every sequence: a proposer whose cost is nil, so a verify step
    costs what verification costs."""

    feature_layers: tuple[int, ...] = ()

    def attach(self, target: object) -> None:
        pass

    def propose(self, batch: list[DraftInput], k: int) -> Proposal:
        import torch

        from specroll.engine.spec.proposer import Proposal

        tokens = torch.arange(3, 3 + k, dtype=torch.long).expand(len(batch), k)  # [B, k]
        return Proposal(tokens, torch.full((len(batch),), k, dtype=torch.long), None)

    def observe(self, updates: object) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass


def start_engine(checkpoint: Checkpoint, args: argparse.Namespace, batch: int, k: int | None) -> Engine:
    """An engine with ``batch`` requests prefilled and warmed up; ``k``: drafts per step (None: none)."""
    import torch

    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.protocol.sampling import SamplingParams

    per_step = 1 + (k or 0)
    max_tokens = (WARMUP_STEPS + args.rounds * args.steps + 2) * per_step
    config = EngineConfig(model="bench_overhead", device=args.device, dtype=args.dtype, max_num_seqs=batch,
                          kv_cache_memory_gb=0.5, num_draft_tokens=k or 1, max_model_len=4096)
    engine = Engine(config, checkpoint=checkpoint, proposer=RareDrafts() if k else None)
    seeded = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, checkpoint.config.vocab_size, (batch, PROMPT_LEN), generator=seeded)  # [B, P]
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i),
                           request_id=f"r{i}")
    while any(not engine.output_so_far(r)[0] for r in engine.live_request_ids()):
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    return engine


def time_round(engine: Engine, steps: int, phases: bool) -> tuple[float, dict[str, float]]:
    """The median wall seconds of ``steps`` steps, and each phase's mean milliseconds per step (the
    phase clock runs during the same steps when ``phases``; else the phases are empty)."""
    engine.phases.reset()
    engine.phases.enabled = phases
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.phases.enabled = False
    return statistics.median(times), dict(engine.phases.totals.per_step_ms()) if phases else {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    checkpoint = tiny_deep_checkpoint(args.vocab, args.layers)
    c = checkpoint.config
    print(f"{c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, {args.dtype} on {args.device}, "
          f"{torch.get_num_threads()} torch threads, k = {args.k}", flush=True)
    results: dict[str, dict[str, object]] = {}
    for batch in args.batch_sizes:
        engines = {"decode": start_engine(checkpoint, args, batch, None),
                   "verify": start_engine(checkpoint, args, batch, args.k)}
        # On the CPU the phase clock reads perf_counter only and times the very steps measured; on
        # CUDA it synchronises, so there the phases come from one extra round.
        inline = args.device == "cpu"
        rounds: dict[str, list[tuple[float, dict[str, float]]]] = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                rounds[mode].append(time_round(engine, args.steps, phases=inline))
        row: dict[str, object] = {}
        for mode, engine in engines.items():
            best, phases = min(rounds[mode], key=lambda r: r[0])
            if not inline:
                phases = time_round(engine, args.steps, phases=True)[1]
            row[mode] = {"step_ms": 1e3 * best, "round_medians_ms": [1e3 * r[0] for r in rounds[mode]],
                         "phases_ms": phases}
        row["verify_over_decode"] = row["verify"]["step_ms"] / row["decode"]["step_ms"]  # type: ignore[index]
        results[str(batch)] = row
        del engines

    phase_names = list(results[str(args.batch_sizes[0])]["decode"]["phases_ms"])  # type: ignore[index]
    print(f"\n{'B':>3} {'mode':>6} {'step ms':>8} | phase means over that round, ms (a slow step weighs in them)")
    print(f"{'':>3} {'':>6} {'':>8} | " + " ".join(f"{p:>9}" for p in phase_names))
    for batch, row in results.items():
        for mode in ("decode", "verify"):
            r = row[mode]
            print(f"{batch:>3} {mode:>6} {r['step_ms']:>8.2f} | "  # type: ignore[index]
                  + " ".join(f"{r['phases_ms'][p]:>9.3f}" for p in phase_names))  # type: ignore[index]
        print(f"{batch:>3} verify / decode = {row['verify_over_decode']:.2f}x")
    metrics: dict[str, dict[str, object]] = {}
    if args.metrics:
        metrics = {str(batch): measure_metrics(checkpoint, args, batch) for batch in args.batch_sizes}
        print_metrics(metrics, args.scrape_interval_s)
    load_after = os.getloadavg()[0]
    print(f"1-min load average {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")
    if args.json is not None:
        report = {"layers": c.num_layers, "hidden": c.hidden_size, "vocab": c.vocab_size, "dtype": args.dtype,
                  "device": args.device, "threads": torch.get_num_threads(), "k": args.k,
                  "load_average": [load_before, load_after], "batch": results}
        if args.metrics:
            report["metrics"] = {"scrape_interval_s": args.scrape_interval_s, "round_s": args.metrics_round_s,
                                 "rounds": args.rounds, "batch": metrics}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
