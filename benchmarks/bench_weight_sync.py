"""Weight sync: the time from ``publish_weights`` to every generator serving the new version (all
``AckWeights``), ZeroMQ chunks against a torch.distributed weights group (gloo on this CPU machine),
for the policy (SmolLM2-135M by default, loaded as the trainer loads it) in bfloat16 and float32 on
the wire, with 1 and 2 generators.

One run, one client, real generator processes (``python -m specroll.actors.generator``, float32
engines, idle: no rollouts): the generators join their groups during a warm-up, then every repeat
publishes one version per (dtype, transport), transports alternating (A B, then B A) so drift on a
shared machine hits both. The client's ``weights_transport`` is switched between publishes: a
``zmq`` announcement is fetched as chunks even by a generator that has a group.

Printed: the median time of each side, the ratio, bytes moved per second (the version's bytes times
the generators), the overheads beyond moving bytes measured in this process (snapshot and cast,
CRC-32 of the buckets, the engine's ``update_weights``), and what the collective path would take
on NCCL: bytes × generators / an assumed bus bandwidth (``--nccl-gbps``, default 100 GB/s, an
NVLink figure on H100/H200-class nodes) plus the measured overheads that stay on the host.

    python benchmarks/bench_weight_sync.py [--repeats 5] [--generators 1,2] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common import int_list

DTYPES = ("bfloat16", "float32")
TRANSPORTS = ("zmq", "collective")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="registered name or checkpoint (default: the default model)")
    p.add_argument("--repeats", type=int, default=5, help="versions per (generators, dtype, transport)")
    p.add_argument("--generators", type=int_list, default=[1, 2], help="generator counts, e.g. 1,2")
    p.add_argument("--bucket-mb", type=int, default=64, help="network.weights_bucket_mb")
    p.add_argument("--nccl-gbps", type=float, default=100.0,
                   help="assumed NCCL bus bandwidth in GB/s for the estimate (default 100: NVLink)")
    p.add_argument("--gen-threads", type=int, default=1, help="torch threads of each generator")
    return p.parse_args()


@contextlib.contextmanager
def generator(endpoint: str, model: str, config: Path, log: Path, actor_id: str,
              threads: int) -> Iterator[subprocess.Popen[bytes]]:
    """One generator process (its own process group), killed and reaped on the way out."""
    cmd = [sys.executable, "-m", "specroll.actors.generator", "--connect", endpoint, "--config", str(config),
           "--model", model, "--actor-id", actor_id, "--dtype", "float32", "--kv-cache-gb", "0.05",
           "--max-model-len", "512", "--threads", str(threads), "--heartbeat-s", "0.5", "--trainer-timeout-s", "120"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


async def measure(args: argparse.Namespace, weights: dict, model: str, workdir: Path) -> list[tuple]:
    """Rows ``(generators, dtype, transport, total_s, publish_s, over_group)`` of every publish."""
    import anyio

    from specroll.actors.trainer.client import RolloutClient

    config = workdir / "collective.toml"
    config.write_text('[network]\nweights_transport = "collective"\n')
    rows: list[tuple] = []
    version = 0
    async with RolloutClient("tcp://127.0.0.1:0", heartbeat_timeout_s=120.0, weights_transport="collective",
                             weights_bucket_mb=args.bucket_mb) as client:
        with contextlib.ExitStack() as stack:
            procs: list[subprocess.Popen[bytes]] = []
            for count in sorted(args.generators):
                while len(procs) < count:
                    log = workdir / f"gen-{len(procs)}.log"
                    procs.append(stack.enter_context(generator(client.endpoint, model, config, log,
                                                               f"gen-{len(procs)}", args.gen_threads)))
                while True:
                    with anyio.move_on_after(1.0):
                        await client.wait_for_generators(count)
                        break
                    for i, proc in enumerate(procs):
                        if proc.poll() is not None:
                            raise SystemExit(f"generator {i} exited with {proc.returncode}:\n"
                                             + (workdir / f"gen-{i}.log").read_text()[-2000:])
                actors = list(client.coordinator.generators)
                print(f"{count} generator(s) ready; warming up (groups are built at the first collective version)",
                      flush=True)
                client.weights_transport = "collective"
                for _ in range(20):  # until every generator received a version over its group
                    version += 1
                    await client.publish_weights(weights, version, dtype="bfloat16")
                    await client.wait_for_version(version, timeout=600)
                    if all(client.weights_groups.broadcasts.get(a, 0) for a in actors):
                        break
                else:
                    raise SystemExit(f"no weights group came up: {client.weights_groups.broadcasts}")
                for rep in range(args.repeats):
                    for dtype in DTYPES:
                        for transport in TRANSPORTS if rep % 2 == 0 else TRANSPORTS[::-1]:
                            client.weights_transport = transport
                            before = sum(client.weights_groups.broadcasts.get(a, 0) for a in actors)
                            version += 1
                            start = time.perf_counter()
                            await client.publish_weights(weights, version, dtype=dtype)
                            published = time.perf_counter()
                            await client.wait_for_version(version, timeout=600)
                            end = time.perf_counter()
                            over = sum(client.weights_groups.broadcasts.get(a, 0) for a in actors) - before
                            rows.append((count, dtype, transport, end - start, published - start, over))
                    print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
                    await anyio.sleep(0)
    return rows


def host_overheads(weights: dict, model: str, bucket_bytes: int) -> dict[tuple[str, str], float]:
    """Seconds, measured here: ``("snapshot", dtype)``, ``("crc32", dtype)``, ``("apply", dtype)``."""
    from specroll.actors.peer.weights_collective import WeightsLayout, bucket_checksums
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.protocol.messages import TensorSpec

    engine = Engine(EngineConfig(model=model, dtype="float32", kv_cache_memory_gb=0.05, max_model_len=512))
    params = [TensorSpec(name=n, shape=tuple(t.shape)) for n, t in weights.items()]
    out: dict[tuple[str, str], float] = {}
    version = 0
    for dtype in DTYPES:
        layout = WeightsLayout.of(params, dtype)
        snap, crc, apply = [], [], []
        for _ in range(5):
            t0 = time.perf_counter()
            flat = layout.flatten(weights)
            t1 = time.perf_counter()
            bucket_checksums(flat, bucket_bytes)
            t2 = time.perf_counter()
            version += 1
            engine.update_weights(layout.views(flat), version)
            t3 = time.perf_counter()
            snap.append(t1 - t0)
            crc.append(t2 - t1)
            apply.append(t3 - t2)
        out["snapshot", dtype], out["crc32", dtype], out["apply", dtype] = map(statistics.median, (snap, crc, apply))
        del flat
    return out


def report(rows: list[tuple], overheads: dict, nbytes: dict[str, int], args: argparse.Namespace) -> None:
    print()
    print(f"publish -> every generator serving it, median of {args.repeats} (bucket {args.bucket_mb} MiB, "
          f"gloo over loopback, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    print(f"{'gens':>4} {'dtype':>9} {'MB':>6} | {'zmq s':>7} {'MB/s':>6} | {'collective s':>12} {'MB/s':>6} | "
          f"{'zmq/coll':>8} | {'publish s (zmq/coll)':>20}")
    for count in sorted(args.generators):
        for dtype in DTYPES:
            mb = nbytes[dtype] / 1e6
            sel = {t: [r for r in rows if r[:3] == (count, dtype, t)] for t in TRANSPORTS}
            med = {t: statistics.median(r[3] for r in sel[t]) for t in TRANSPORTS}
            pub = {t: statistics.median(r[4] for r in sel[t]) for t in TRANSPORTS}
            missed = sum(r[5] < count for r in sel["collective"])
            note = f"  ({missed} collective versions went partly as chunks)" if missed else ""
            print(f"{count:>4} {dtype:>9} {mb:>6.0f} | {med['zmq']:>7.3f} {mb * count / med['zmq']:>6.0f} | "
                  f"{med['collective']:>12.3f} {mb * count / med['collective']:>6.0f} | "
                  f"{med['zmq'] / med['collective']:>7.2f}x | {pub['zmq']:>9.3f} / {pub['collective']:.3f}{note}")
    print()
    print("overheads beyond the bytes, median of 5 in this process (s; first-touch page faults included):")
    for dtype in DTYPES:
        print(f"  {dtype:>9}: snapshot+cast {overheads['snapshot', dtype]:.3f}, CRC-32 of all buckets "
              f"{overheads['crc32', dtype]:.3f} (once at publish, again on each generator, overlapped with the "
              f"next bucket), update_weights {overheads['apply', dtype]:.3f}")
    print()
    print(f"NCCL estimate (assumption: {args.nccl_gbps:.0f} GB/s bus bandwidth out of the trainer's GPU, shared by "
          "one send per generator), plus the CRC-32 on both ends (host work, after a device-to-host copy):")
    for count in sorted(args.generators):
        for dtype in DTYPES:
            wire = nbytes[dtype] * count / (args.nccl_gbps * 1e9)
            crc = 2 * overheads["crc32", dtype]
            print(f"  {count} gen {dtype:>9}: bytes {wire * 1e3:5.1f} ms + CRC-32 {crc * 1e3:4.0f} ms = "
                  f"{(wire + crc) * 1e3:4.0f} ms; the snapshot and the apply are device copies there (not measured)")


def main() -> None:
    args = parse_args()
    import anyio
    import torch

    from specroll.engine.checkpoint import load_checkpoint
    from specroll.engine.model import CausalLM
    from specroll.engine.registry import DEFAULT_MODEL, resolve_model

    model = str(resolve_model(args.model or DEFAULT_MODEL))
    ckpt = load_checkpoint(model, torch.float32)  # as the trainer loads its policy (setup.py)
    policy = CausalLM(ckpt.config).to(torch.float32)
    policy.load_weights(ckpt.weights)
    weights = {n: t.detach() for n, t in policy.hf_weights().items()}
    del ckpt
    numel = sum(t.numel() for t in weights.values())
    nbytes = {"bfloat16": 2 * numel, "float32": 4 * numel}
    print(f"{model}: {len(weights)} tensors, {numel / 1e6:.1f}M parameters", flush=True)
    overheads = host_overheads(weights, model, args.bucket_mb << 20)
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        rows = anyio.run(measure, args, weights, model, Path(tmp), backend="asyncio")
    report(rows, overheads, nbytes, args)


if __name__ == "__main__":
    main()
