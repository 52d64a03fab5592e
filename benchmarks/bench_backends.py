"""Attention backends on a GPU: decode tokens/s of the torch reference against FlashInfer, and
speculative against plain decoding at batch 1, in one run.

The model is a random-weight stand-in with SmolLM2-135M's exact shapes (30 layers, 9/3 heads of
64, vocabulary 49152; ``model_config.SMOLLM2_135M``), in bfloat16: the GGUF does not travel to GPU
machines, and speed depends only on the shapes. Each figure runs B requests together (128 random
prompt tokens, 128 sampled response tokens at temperature 1, EOS ignored) and counts the response
tokens of pure decode steps over those steps' wall-clock time, after a warm-up run per backend
(whose time, FlashInfer's JIT compilation included, is reported as ``warmup_s``).

``flashinfer-graphs`` is FlashInfer with decode and verify steps replayed as CUDA graphs
(``cuda_graphs = "on"``); with both FlashInfer columns the ratio graphs / eager is printed, for
decoding at each batch size and for speculative decoding at batch 1. ``flashinfer-compiled`` and
``flashinfer-compiled-graphs`` add ``compile = "on"`` (the decoder as one ``torch.compile``d graph,
captured inside the CUDA graphs); with ``flashinfer-graphs`` the ratio compiled + graphs / graphs is printed.

Speculative decoding at batch 1 replays the greedy rollout of the prompt as drafts (k = 4,
``ReplayProposer``), iterated until the speculative run reproduces the rollout it replays: every
draft is then accepted, so the ratio is what verification allows when the drafter is perfect and
free — the mechanism's ceiling on this GPU, not a drafter's speedup.

Usage::

    python benchmarks/bench_backends.py --json gpu_bench.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from common import int_list


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16, 64], help="batch sizes (default 1,16,64)")
    parser.add_argument("--backends", type=_backends, default=["torch", "flashinfer"],
                        help="comma-separated backends to compare: torch, flashinfer, flashinfer-graphs "
                             "(FlashInfer with CUDA graphs) (default torch,flashinfer)")
    parser.add_argument("--prompt-tokens", type=_positive, default=128)
    parser.add_argument("--max-tokens", type=_positive, default=128)
    parser.add_argument("--repeats", type=_positive, default=3, help="timed runs per figure; the median is kept")
    parser.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache per engine, GiB (two engines "
                        "live at once during the speculative figure)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--profile", type=Path, help="write torch.profiler tables of one plain and one speculative "
                        "batch-1 run here (where a speculative step's time goes)")
    args = parser.parse_args(argv)

    import torch

    from specroll.engine.loaders.checkpoint import random_checkpoint
    from specroll.engine.model_config import SMOLLM2_135M

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: this machine has no CUDA GPU", file=sys.stderr)
        return 2
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        print(f"--device {args.device!r}: expected cuda, cuda:N or cpu", file=sys.stderr)
        return 2
    if any(b.startswith("flashinfer") for b in args.backends) and not args.device.startswith("cuda"):
        print("--backends flashinfer and flashinfer-graphs need --device cuda", file=sys.stderr)
        return 2
    if not args.kv_cache_gb > 0:
        print(f"--kv-cache-gb {args.kv_cache_gb}: expected a positive number", file=sys.stderr)
        return 2
    checkpoint = random_checkpoint(SMOLLM2_135M, seed=0, std=0.05)
    backends = args.backends
    results: dict = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "model": "random weights, SmolLM2-135M shapes, bfloat16",
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "warmup_s": {},
        "decode_tokens_per_s": {},
    }
    try:
        import flashinfer

        results["flashinfer"] = flashinfer.__version__
    except ImportError:
        results["flashinfer"] = None
    for backend in backends:
        engine = _engine(checkpoint, backend, args.device, max(args.batch_sizes), args.kv_cache_gb)
        start = time.perf_counter()
        _run(engine, _prompts(2, args.prompt_tokens, seed=99), 8, temperature=1.0)
        results["warmup_s"][backend] = round(time.perf_counter() - start, 2)
        results["decode_tokens_per_s"][backend] = {}
        for b in args.batch_sizes:
            rates = [_run(engine, _prompts(b, args.prompt_tokens, seed=r), args.max_tokens, 1.0)[0]
                     for r in range(args.repeats)]
            results["decode_tokens_per_s"][backend][b] = round(statistics.median(rates), 1)
            print(f"{backend:>10}  B={b:<3} {results['decode_tokens_per_s'][backend][b]:>9.1f} tok/s", flush=True)
        del engine
    if set(backends) >= {"torch", "flashinfer"}:
        tps = results["decode_tokens_per_s"]
        results["flashinfer_over_torch"] = {b: round(tps["flashinfer"][b] / tps["torch"][b], 2)
                                            for b in args.batch_sizes}
    if set(backends) >= {"flashinfer", "flashinfer-graphs"}:
        tps = results["decode_tokens_per_s"]
        results["graphs_over_eager"] = {b: round(tps["flashinfer-graphs"][b] / tps["flashinfer"][b], 2)
                                        for b in args.batch_sizes}
    if set(backends) >= {"flashinfer-graphs", "flashinfer-compiled-graphs"}:
        tps = results["decode_tokens_per_s"]
        results["compiled_graphs_over_graphs"] = {
            b: round(tps["flashinfer-compiled-graphs"][b] / tps["flashinfer-graphs"][b], 2) for b in args.batch_sizes}
    fast = [b for b in backends if b.startswith("flashinfer")] or backends[:1]
    results["speculative_batch1"] = {b: _speculative(checkpoint, b, args) for b in fast}
    if {"flashinfer", "flashinfer-graphs"} <= set(fast):
        spec = results["speculative_batch1"]
        results["speculative_graphs_over_eager"] = round(
            spec["flashinfer-graphs"]["speculative_tokens_per_s"] / spec["flashinfer"]["speculative_tokens_per_s"], 2)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def _backends(text: str) -> list[str]:
    names = text.split(",")
    known = ("torch", "flashinfer", "flashinfer-graphs", "flashinfer-compiled", "flashinfer-compiled-graphs")
    if not names or any(n not in known for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct names from {', '.join(known)} (comma-separated)")
    return names


def _engine(checkpoint, backend: str, device: str, max_num_seqs: int, kv_cache_gb: float, proposer=None):
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine

    graphs, compiled = backend.endswith("-graphs"), "-compiled" in backend  # flashinfer[-compiled][-graphs]
    config = EngineConfig(model="random", backend=backend.split("-")[0], device=device,
                          dtype="bfloat16", kv_cache_memory_gb=kv_cache_gb, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=16384, cuda_graphs="on" if graphs else "off",
                          compile="on" if compiled else "off")
    return Engine(config, checkpoint=checkpoint, proposer=proposer)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(256), k=length) for _ in range(n)]


def _run(engine, prompts: list[list[int]], max_tokens: int, temperature: float) -> tuple[float, dict]:
    """Run ``prompts`` together; return (response tokens/s over pure decode steps, completions)."""
    from specroll.protocol.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, sampling, f"r{i}", group_id=f"g{i}")
    tokens, seconds, done = 0, 0.0, {}
    while engine.has_unfinished():
        decoding = not engine.scheduler.waiting and all(s.num_computed_tokens for s in engine.scheduler.running)
        start = time.perf_counter()
        outputs = engine.step()
        if decoding:
            seconds += time.perf_counter() - start
            tokens += sum(len(o.new_token_ids) for o in outputs)
        for o in outputs:
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens / seconds if seconds else 0.0, done


def _speculative(checkpoint, backend: str, args: argparse.Namespace) -> dict:
    from specroll.drafter.replay import ReplayProposer

    prompts = _prompts(1, args.prompt_tokens, seed=7)
    plain = _engine(checkpoint, backend, args.device, 1, args.kv_cache_gb)
    _, done = _run(plain, prompts, args.max_tokens, temperature=0.0)
    # bf16 verify and decode kernels round differently, so on random weights (full of near-ties)
    # plain greedy output is not quite what verification computes: replay the speculative run's own
    # output until it reproduces itself, so every draft is one the verifier accepts.
    proposer = ReplayProposer({"g0": prompts[0] + done["r0"]})
    spec = _engine(checkpoint, backend, args.device, 1, args.kv_cache_gb, proposer)
    rounds = 0
    while rounds < 5:
        rounds += 1
        _, again = _run(spec, prompts, args.max_tokens, temperature=0.0)
        if prompts[0] + again["r0"] == proposer.rollouts["g0"]:
            break
        proposer.rollouts["g0"] = prompts[0] + again["r0"]
    spec.spec_stats = type(spec.spec_stats)()
    plain_rates, spec_rates = [], []
    for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
        plain_rates.append(_run(plain, prompts, args.max_tokens, 0.0)[0])
        spec_rates.append(_run(spec, prompts, args.max_tokens, 0.0)[0])
    figures = {
        "backend": backend,
        "k": spec.config.num_draft_tokens,
        "plain_tokens_per_s": round(statistics.median(plain_rates), 1),
        "speculative_tokens_per_s": round(statistics.median(spec_rates), 1),
        "acceptance_length": round(spec.spec_stats.acceptance_length, 2),
        "replay_rounds": rounds,
    }
    figures["ratio"] = round(figures["speculative_tokens_per_s"] / figures["plain_tokens_per_s"], 2)
    print(f"speculative B=1 ({backend}): {figures}", flush=True)
    if args.profile and backend == "flashinfer":
        _profile(args.profile, {"plain": plain, "speculative": spec}, prompts, args.max_tokens)
    return figures


def _profile(path: Path, engines: dict, prompts: list[list[int]], max_tokens: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    tables = []
    for name, engine in engines.items():
        with profile(activities=activities) as prof:
            rate, _ = _run(engine, prompts, max_tokens, 0.0)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        tables.append(f"== {name}: {rate:.1f} tok/s ==\n"
                      f"{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=25)}\n"
                      f"{prof.key_averages().table(sort_by=sort, row_limit=15)}")
    path.write_text("\n".join(tables))


if __name__ == "__main__":
    sys.exit(main())
