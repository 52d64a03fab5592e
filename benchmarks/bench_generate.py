"""Generation throughput: specroll's engine against Hugging Face ``generate()`` on the same prompts.

Both sides run the same checkpoint in the same dtype on the same GSM8K prompts, tokenized once
with specroll's tokenizer and chat template (``encode_chat(format_question(q))``), so they see
identical prompt token ids. Both sample with temperature 1, no top-k and no top-p filter, up to
``--max-new-tokens`` response tokens, stopping at the tokenizer's EOS ids.

- **specroll**: every prompt is queued at once and :func:`run_to_completion` steps the engine;
  continuous batching keeps at most ``B`` sequences in flight (``max_num_seqs=B``) and refills a
  slot as soon as a sequence finishes.
- **transformers**: the prompts go through ``model.generate`` in chunks of ``B``, left-padded
  (pad = EOS) with an attention mask, SDPA attention. The weights are transformers' own
  dequantization of the GGUF file (``load_gguf_checkpoint``), loaded into a model class built from
  specroll's :class:`ModelConfig`, so both sides have the same architecture hyper-parameters.

- **llama.cpp** (a reference column, when ``llama-cpp-python`` is installed and the model is a GGUF
  file): the same GGUF through ``llama_cpp.Llama.generate`` with the same sampling (T = 1, no top-k,
  top-p or min-p filter, no repetition penalty), one prompt after another — its Python API runs
  one sequence at a time, so at batch B it is the same sequential run. llama.cpp computes with the
  file's quantized weights (Q4_1 for the default model: ~5 bits a weight), where specroll and
  transformers dequantize them to the benchmark's dtype: it reads 3-4x fewer bytes per token.

The figure compared is **useful tokens per second**: generated tokens up to and including each
response's first EOS, divided by the wall-clock time of generation (prefill included, model
loading excluded). Counting the raw output width would flatter ``generate()``: a finished row of
its batch keeps being computed, and padded, until the batch's longest response ends. Those padding
tokens cost time but are not rollouts, so they are not counted. Sampling is random, so the two
sides' responses differ in length; tokens/s normalises for it, and more prompts steady it.

A second figure puts specroll's single-sequence decode step against a memory-bandwidth floor: at
batch 1 a decode step reads every weight once, so it costs at least about ``weight bytes /
bandwidth``. The bandwidth is measured in the same run as the rate ``dst.copy_(src)`` moves a
256 MiB float32 tensor, counting the bytes of ``src`` only. A copy also writes what it reads, so a
pure read of the weights may stream somewhat faster: the floor is a reproducible yardstick, not a
hard bound. ``decode_step_over_floor`` is the median step time over it; 1 would be a step that does
nothing but stream its weights.

Timing is wall-clock and the machine is shared: another busy process on a 2-core machine stalls
every op of a 2-thread torch at its thread barrier (steps 10x slower). The 1-minute load average is
printed and written with the results; ``--threads 1`` is far less sensitive to it.

Usage::

    python benchmarks/bench_generate.py --prompts data/gsm8k/test.jsonl --json bench.json

(``data/gsm8k/test.jsonl``: GSM8K's test split as JSONL, see docs/getting-started.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common import int_list
from generate_references import build_hf_model, llama_cpp_problem, run_hf, run_llama_cpp

from specroll.actors.cli import positive_int as _positive_int
from specroll.rl.tasks import PromptFileError, format_question, load_prompts

if TYPE_CHECKING:
    import torch

    from specroll.engine.engine import Engine

COPY_BYTES = 256 * 2**20
"""Size of the tensor the bandwidth probe copies: far above any CPU cache."""
DECODE_WARMUP_STEPS = 3
"""Decode steps run, and not timed, before the timed ones of the decode-step probe."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Useful tokens/s of specroll's engine and of transformers' generate() on the same "
                    "prompts, at several batch sizes, and specroll's decode step against a bandwidth floor.",
    )
    p.add_argument("--prompts", required=True, type=Path, help="GSM8K-style JSONL file ('question' per line)")
    p.add_argument("--json", required=True, type=Path, help="where to write the results as JSON")
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, Hugging Face checkpoint directory or .gguf file (default: %(default)s)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 16],
                   help="comma-separated batch sizes: specroll's max_num_seqs and generate()'s chunk "
                        "(default: 1,16)")
    p.add_argument("--num-prompts", type=int_list, default=[8, 64],
                   help="prompts per batch size: one number for all, or one per --batch-sizes entry "
                        "(default: 8,64)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128,
                   help="response tokens at most (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weight and activation dtype of both sides; auto = the engine's default "
                        "(bfloat16 on CPUs with native bf16, else float32) (default: %(default)s)")
    p.add_argument("--decode-steps", type=_positive_int, default=40,
                   help="timed single-sequence decode steps for the floor ratio, >= 30 (default: %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads for both sides (default: torch's own choice). With 2 threads "
                        "on 2 cores, any other busy process stalls every op at a thread barrier")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of both sides (default: %(default)s)")
    args = p.parse_args(argv)
    if len(args.num_prompts) == 1:
        args.num_prompts = args.num_prompts * len(args.batch_sizes)
    if len(args.num_prompts) != len(args.batch_sizes):
        p.error(f"--num-prompts has {len(args.num_prompts)} values and --batch-sizes {len(args.batch_sizes)}; "
                "give one number or one per batch size")
    if args.decode_steps < 30:
        p.error(f"--decode-steps={args.decode_steps}, expected at least 30 for a stable median")
    try:
        args.questions = [q.question for q in load_prompts(args.prompts, limit=max(args.num_prompts))]
    except PromptFileError as exc:
        p.error(str(exc))
    if len(args.questions) < max(args.num_prompts):
        p.error(f"{args.prompts} holds {len(args.questions)} prompts, --num-prompts asks for {max(args.num_prompts)}")
    return args


# ---- bandwidth floor -----------------------------------------------------------------------


def copy_bandwidth(repeats: int = 10) -> float:
    """Bytes per second ``dst.copy_(src)`` moves for a float32 tensor of :data:`COPY_BYTES`; best of
    ``repeats`` after one untimed copy that faults the pages in."""
    import torch

    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)  # [64 Mi]
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() * src.element_size() / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters; ``parameters()`` yields a tied embedding/LM head once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_step_seconds(engine: Engine, prompt: list[int], steps: int, seed: int) -> float:
    """Median wall time of ``engine.step()`` over ``steps`` decode steps of one sequence.

    The request ignores EOS so that it decodes for exactly as long as it is timed.
    """
    from specroll.protocol.sampling import SamplingParams

    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=1 + DECODE_WARMUP_STEPS + steps,
                              seed=seed, ignore_eos=True)
    engine.add_request(prompt, sampling, request_id="decode-probe")
    while not engine.step():  # prefill chunks sample nothing; the last one samples the first token
        pass
    for _ in range(DECODE_WARMUP_STEPS):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        assert len(outputs) == 1, "one sequence decodes one token per step"
    assert outputs[0].finished and not engine.has_unfinished()
    return statistics.median(times)


# ---- specroll's side (the others: generate_references.py) ---------------------------------


def run_specroll(engine: Engine, prompts: list[list[int]], max_new_tokens: int, seed: int) -> tuple[int, float]:
    """Queue every prompt, run the engine dry; returns (response tokens, seconds)."""

    from specroll.actors.jobs.progress import run_with_progress
    from specroll.protocol.sampling import SamplingParams

    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_new_tokens, seed=seed * 1_000_003 + i)
        engine.add_request(prompt, sampling, request_id=f"p{i}")
    run = run_with_progress(engine, total=len(prompts), desc=f"specroll B={engine.config.max_num_seqs}")
    done, elapsed = run.completions, run.seconds
    assert len(done) == len(prompts)
    return sum(len(c.token_ids) for c in done.values()), elapsed


# ---- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from common import setup_torch

    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.engine.loaders.registry import resolve_model

    dtype, args.dtype, threads, load_before = setup_torch(args.threads, args.dtype)
    print(f"model {args.model}, dtype {args.dtype}, {threads} torch threads, "
          f"max_new_tokens {args.max_new_tokens}", flush=True)

    bandwidth = copy_bandwidth()
    checkpoint = load_checkpoint(args.model, dtype=dtype)
    tokenizer = checkpoint.tokenizer
    prompts = [tokenizer.encode_chat(format_question(q)) for q in args.questions]

    def engine(max_num_seqs: int) -> Engine:
        config = EngineConfig(model=args.model, max_num_seqs=max_num_seqs, dtype=args.dtype, seed=args.seed)
        return Engine(config, checkpoint=checkpoint)

    # A fresh engine, so its prompt pages do not sit in a measured engine's prefix cache.
    probe = engine(1)
    weights = weight_bytes(probe.model)
    floor = weights / bandwidth
    step = decode_step_seconds(probe, prompts[0], args.decode_steps, args.seed)
    eos_token_ids = sorted(probe.eos_token_ids)
    del probe
    print(f"weights {weights / 1e6:.1f} MB, copy bandwidth {bandwidth / 1e9:.2f} GB/s -> floor "
          f"{floor * 1e3:.2f} ms; specroll decode step {step * 1e3:.2f} ms "
          f"(median of {args.decode_steps}) = {step / floor:.2f} x floor", flush=True)

    source = resolve_model(args.model)
    hf_model = build_hf_model(checkpoint, source, dtype)
    run_hf(hf_model, prompts[:1], 1, 4, eos_token_ids, args.seed)  # warm-up: first-call costs
    no_llama_cpp = llama_cpp_problem(source)
    if no_llama_cpp is not None:
        print(f"llama.cpp column skipped: {no_llama_cpp}", flush=True)

    results: dict[str, dict[str, float | int]] = {}
    for batch_size, num_prompts in zip(args.batch_sizes, args.num_prompts, strict=True):
        batch_prompts = prompts[:num_prompts]
        ours = engine(batch_size)
        s_tokens, s_seconds = run_specroll(ours, batch_prompts, args.max_new_tokens, args.seed)
        del ours
        h_tokens, h_seconds = run_hf(hf_model, batch_prompts, batch_size, args.max_new_tokens, eos_token_ids,
                                     args.seed)
        s_rate, h_rate = s_tokens / s_seconds, h_tokens / h_seconds
        results[str(batch_size)] = {
            "specroll_tok_s": s_rate, "hf_tok_s": h_rate, "ratio": s_rate / h_rate,
            "specroll_tokens": s_tokens, "hf_tokens": h_tokens, "specroll_s": s_seconds, "hf_s": h_seconds,
            "num_prompts": num_prompts,
        }
        if no_llama_cpp is None:
            l_tokens, l_seconds = run_llama_cpp(source, batch_prompts, args.max_new_tokens, eos_token_ids, args.seed,
                                                threads)
            results[str(batch_size)].update(llama_cpp_tok_s=l_tokens / l_seconds, llama_cpp_tokens=l_tokens,
                                            llama_cpp_s=l_seconds, ratio_llama_cpp=s_rate / (l_tokens / l_seconds))

    print()
    print(f"{'batch':>5} {'prompts':>7} | {'specroll tok':>12} {'s':>7} {'tok/s':>7} | "
          f"{'hf tok':>7} {'s':>7} {'tok/s':>7} | {'ratio':>6} | {'llama.cpp tok/s':>15} {'ratio':>6}")
    for batch_size, r in results.items():
        llama = (f"{r['llama_cpp_tok_s']:>15.1f} {r['ratio_llama_cpp']:>5.2f}x" if "llama_cpp_tok_s" in r
                 else f"{'-':>15} {'-':>6}")
        print(f"{batch_size:>5} {r['num_prompts']:>7} | {r['specroll_tokens']:>12} {r['specroll_s']:>7.1f} "
              f"{r['specroll_tok_s']:>7.1f} | {r['hf_tokens']:>7} {r['hf_s']:>7.1f} {r['hf_tok_s']:>7.1f} | "
              f"{r['ratio']:>5.2f}x | {llama}")
    print(f"decode step {step * 1e3:.2f} ms / floor {floor * 1e3:.2f} ms = {step / floor:.2f}  "
          f"(weights {weights / 1e6:.1f} MB at {bandwidth / 1e9:.2f} GB/s)")

    # Other processes on the machine skew both sides, not necessarily alike; the load shows them.
    load_after = os.getloadavg()[0]
    print(f"1-min load average {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")

    report = {
        "model": args.model, "dtype": args.dtype, "threads": threads, "max_new_tokens": args.max_new_tokens,
        "weight_bytes": weights, "copy_bandwidth_gb_s": bandwidth / 1e9, "floor_ms": floor * 1e3,
        "decode_step_ms": step * 1e3, "decode_step_over_floor": step / floor,
        "load_average": [load_before, load_after], "batch": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
