"""The specroll arm of ``bench_vs_vllm.py``: a worker that times specroll's engine on the requests the
orchestrator sends, speaking the JSON lines of ``vllm_offline_arm.py`` (the vLLM arm), so the two arms
are driven alike and interleaved.

Started as::

    python specroll_offline_arm.py --model smollm2-135m --threads 2 --max-num-seqs 64 \\
        --compile on --compile-cache-dir DIR

it builds an :class:`~specroll.engine.engine.Engine` in bfloat16 with prefix caching off (as vLLM's arm),
runs one warm-up request — a prefill and batch-1 decodes, so a compiled engine compiles (or loads from
``DIR``) both its graphs — and answers:

- stdout, once: ``{"ready": true, "start_s": <engine build + warm-up, s>, "build_s": ..., "warmup_s": ...,
  "compile_s": <of it, compiling>, "counters": {"graphs", "cache_hits", "cache_misses"}, "decode_step_s":
  <median batch-1 decode step, s>, "floor_s": <weight bytes / copy bandwidth, s>, "packed_bytes": ...}``.
- stdin/stdout: the requests and replies of ``vllm_offline_arm.py`` (every prompt queued at once; prompt
  ``i`` seeded ``seed + i``; the reply's ``seconds`` from the first ``add_request`` to the last token).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from vllm_offline_arm import Protocol, Request, serve, timed_build

DECODE_PROBE_STEPS = 30


def build(args: argparse.Namespace):  # -> Engine (imports torch lazily)
    import torch

    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                          max_model_len=args.max_model_len, kv_cache_memory_gb=args.kv_cache_gb,
                          enable_prefix_caching=False, compile=args.compile,
                          compile_cache_dir=args.compile_cache_dir, pack_weights=args.pack == "on", seed=0)
    return Engine(config)


def run_request(engine, request: Request) -> dict[str, Any]:
    """Queue every prompt, step the engine dry: wall time and generated tokens."""
    from specroll.protocol.sampling import SamplingParams

    start = time.perf_counter()
    for i, prompt in enumerate(request.prompts):
        sampling = SamplingParams(temperature=request.temperature, max_tokens=request.max_tokens,
                                  ignore_eos=request.ignore_eos,
                                  seed=None if request.seed is None else request.seed + i)
        engine.add_request(prompt, sampling, request_id=f"b{time.monotonic_ns()}-{i}")
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "prompts": len(request.prompts), "prompt_tokens": sum(len(p) for p in request.prompts)}


def decode_probe(engine, prompt: list[int]) -> float:
    """Median wall time of a batch-1 decode step, s."""
    from specroll.protocol.sampling import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=DECODE_PROBE_STEPS + 5, ignore_eos=True,
                                              seed=0), request_id="probe")
    while not engine.step():
        pass
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def floor_seconds(engine) -> float:
    """Weight bytes over the copy bandwidth (``bench_generate.copy_bandwidth``): a batch-1 decode step reads
    every weight once, so it costs at least about this."""
    from bench_generate import copy_bandwidth, weight_bytes

    return weight_bytes(engine.model) / copy_bandwidth()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None, help="registered name, HF folder or .gguf (default: the engine's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--compile", choices=("off", "on"), default="on")
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--pack", choices=("off", "on"), default="on", help="EngineConfig.pack_weights")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = Protocol()
    if args.model is None:
        from specroll.engine.loaders.registry import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    from specroll.engine.compiled_step import CompileCounters

    start = time.perf_counter()
    started = timed_build(protocol, lambda: build(args))
    if started is None:
        return 1
    engine, build_s = started
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is 12 times 7? Think step by step."}])
    run_request(engine, Request([prompt], 8, 1.0, 0, True, False))  # prefill (T > 1), batch-1 decode (T = 1)
    start_s = time.perf_counter() - start
    layer = engine.runner.layers
    protocol.send({"ready": True, "start_s": start_s, "build_s": build_s, "warmup_s": start_s - build_s,
                   "compile_s": getattr(layer, "compile_seconds", 0.0), "counters": CompileCounters.read().__dict__,
                   "decode_step_s": decode_probe(engine, prompt), "floor_s": floor_seconds(engine),
                   "packed_bytes": engine.runner.packed_bytes})
    serve(lambda request: run_request(engine, request), protocol, sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
