"""What a rollout client's memory holds over many weight syncs: ``--syncs`` publishes of the same
weights (the default model, as the trainer loads it) to one real generator process, each waited
for until the generator acknowledged it. Every ``--every`` syncs it prints the client process's
resident memory, what Python objects hold (``tracemalloc``) and glibc's own accounting
(``mallinfo2``: bytes in use and free inside the heap arenas, bytes in mmapped blocks), so a
growth of the resident memory can be told apart: live objects grow ``in use``/``python``; memory
freed but kept by the allocator grows ``free``.

    python benchmarks/weight_sync_memory.py [--syncs 300] [--every 25] [--dtype bfloat16] [--wait-every 1]
        [--hold float32]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo() -> MallInfo2 | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        return libc.mallinfo2()
    except (OSError, AttributeError):
        return None


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def main(args: argparse.Namespace) -> None:

    import torch

    from specroll.actors.rollout.client import RolloutClient
    from specroll.engine.loaders.checkpoint import load_checkpoint

    weights = {name: t.to(getattr(torch, args.hold)) for name, t in load_checkpoint(args.model).weights.items()}
    tracemalloc.start()
    mb = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        async with RolloutClient(heartbeat_timeout_s=120) as client:
            log = open(Path(tmp) / "gen.log", "wb")
            gen = subprocess.Popen([sys.executable, "-m", "specroll.actors.generator", "--connect", client.endpoint,
                                    "--model", args.model, "--actor-id", "gen-0", "--dtype", "float32",
                                    "--kv-cache-gb", "0.05", "--max-model-len", "1024", "--threads", "1"],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                await client.wait_for_generators(1, timeout=300)
                print("sync  rss_MB  python_MB  heap_in_use_MB  heap_free_MB  mmapped_MB  s/sync", flush=True)
                start = time.perf_counter()
                for version in range(1, args.syncs + 1):
                    await client.publish_weights(weights, version=version, dtype=args.dtype)
                    if version % args.wait_every == 0:  # else the next publish overtakes this one's fetch
                        await client.wait_for_version(version, timeout=300)
                    if version % args.every == 0 or version == 1:
                        info = mallinfo()
                        python = tracemalloc.get_traced_memory()[0] / mb
                        heap = (f"{info.uordblks / mb:14.0f}  {info.fordblks / mb:12.0f}  {info.hblkhd / mb:10.0f}"
                                if info else "n/a")
                        took = (time.perf_counter() - start) / version
                        print(f"{version:4d}  {rss_mb():6.0f}  {python:9.1f}  {heap}  {took:6.2f}", flush=True)
                snapshot = tracemalloc.take_snapshot()
                print("largest Python allocations at the end:")
                for stat in snapshot.statistics("lineno")[:8]:
                    print(f"  {stat}")
            finally:
                gen.terminate()
                gen.wait(timeout=60)
                log.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--syncs", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--hold", default="float32", choices=["bfloat16", "float32"],
                   help="dtype of the weights the client publishes from (a bfloat16 policy: the cast is a copy)")
    p.add_argument("--wait-every", type=int, default=1,
                   help="wait for the generator's acknowledgement after every N publishes (default: each)")
    args = p.parse_args()
    import anyio

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    anyio.run(main, args)
