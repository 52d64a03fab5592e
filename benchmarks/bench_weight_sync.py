"""Weight sync: the time from ``publish_weights`` to every generator serving the new version (all
``AckWeights``), ZeroMQ chunks against a torch.distributed weights group (gloo on this CPU machine),
for the policy (SmolLM2-135M by default, loaded as the trainer loads it) in bfloat16 and float32 on
the wire, with 1 and 2 generators, with and without ZeroMQ CURVE (``network.security``).

One run, one client, real generator processes (``python -m specroll.actors.generator``, float32
engines, idle: no rollouts): the generators join their groups during a warm-up, then every repeat
publishes one version per (dtype, transport), transports alternating (A B, then B A) so drift on a
shared machine hits both. The client's ``weights_transport`` is switched between publishes: a
``zmq`` announcement is fetched as chunks even by a generator that has a group. With ``--security
none,curve`` there is one client (and its own generators) per mode, and every repeat publishes on
both in turn: CURVE encrypts every ZeroMQ frame (the chunks and the announcements), while a
collective broadcast's bytes go over gloo unencrypted whatever the mode.

Printed: the median time of each side, the ratio, bytes moved per second (the version's bytes times
the generators), the overheads beyond moving bytes measured in this process (snapshot and cast,
CRC-32 of the buckets, the engine's ``update_weights``), and what the collective path would take
on NCCL: bytes × generators / an assumed bus bandwidth (``--nccl-gbps``, default 100 GB/s, an
NVLink figure on H100/H200-class nodes) plus the measured overheads that stay on the host.

    python benchmarks/bench_weight_sync.py [--repeats 5] [--generators 1,2] [--bucket-mb 64]
        [--security none,curve]
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
from typing import TYPE_CHECKING

from common import int_list

if TYPE_CHECKING:
    from specroll.actors.rollout.client import RolloutClient

DTYPES = ("bfloat16", "float32")
TRANSPORTS = ("zmq", "collective")
SECURITY = ("none", "curve")


def security_list(text: str) -> list[str]:
    """``none,curve`` → ``["none", "curve"]``; argparse shows the ValueError's message."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in SECURITY]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"security modes must be among {', '.join(SECURITY)}, got {text!r}")
    return list(dict.fromkeys(modes))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="registered name or checkpoint (default: the default model)")
    p.add_argument("--repeats", type=int, default=5, help="versions per (generators, dtype, transport)")
    p.add_argument("--generators", type=int_list, default=[1, 2], help="generator counts, e.g. 1,2")
    p.add_argument("--bucket-mb", type=int, default=64, help="network.weights_bucket_mb")
    p.add_argument("--nccl-gbps", type=float, default=100.0,
                   help="assumed NCCL bus bandwidth in GB/s for the estimate (default 100: NVLink)")
    p.add_argument("--gen-threads", type=int, default=1, help="torch threads of each generator")
    p.add_argument("--security", type=security_list, default=["none"],
                   help="network.security modes to compare, e.g. none,curve (default: none)")
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
    """Rows ``(security, generators, dtype, transport, total_s, publish_s, over_group)`` of every
    publish."""
    import anyio

    from specroll.actors.rollout.client import RolloutClient
    from specroll.protocol.curve import ServerKeys, init_keys

    keys = workdir / "keys"
    if "curve" in args.security:
        init_keys(keys)
    rows: list[tuple] = []
    version = 0
    async with contextlib.AsyncExitStack() as clients:
        client: dict[str, RolloutClient] = {}
        config: dict[str, Path] = {}
        for mode in args.security:
            config[mode] = workdir / f"{mode}.toml"
            secured = f'security = "curve"\nkeys_dir = "{keys}"\n' if mode == "curve" else ""
            config[mode].write_text(f'[network]\nweights_transport = "collective"\n{secured}')
            client[mode] = await clients.enter_async_context(RolloutClient(
                "tcp://127.0.0.1:0", heartbeat_timeout_s=120.0, weights_transport="collective",
                weights_bucket_mb=args.bucket_mb, curve=ServerKeys.load(keys) if mode == "curve" else None))
        with contextlib.ExitStack() as stack:
            procs: dict[str, list[subprocess.Popen[bytes]]] = {mode: [] for mode in args.security}
            actors: dict[str, list[str]] = {}
            for count in sorted(args.generators):
                for mode in args.security:
                    while len(procs[mode]) < count:
                        name = f"gen-{mode}-{len(procs[mode])}"
                        procs[mode].append(stack.enter_context(generator(
                            client[mode].endpoint, model, config[mode], workdir / f"{name}.log", name,
                            args.gen_threads)))
                    actors[mode] = await ready(client[mode], procs[mode], count, workdir, mode)
                    version = await warm_up(client[mode], weights, version, actors[mode])
                print(f"{count} generator(s) per mode ready, groups up", flush=True)
                for rep in range(args.repeats):
                    for dtype in DTYPES:
                        for mode in args.security if rep % 2 == 0 else args.security[::-1]:
                            for transport in TRANSPORTS if rep % 2 == 0 else TRANSPORTS[::-1]:
                                version += 1
                                row = await publish(client[mode], weights, version, dtype, transport, actors[mode])
                                rows.append((mode, count, dtype, transport, *row))
                    print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
                    await anyio.sleep(0)
    return rows


async def ready(client: RolloutClient, procs: list[subprocess.Popen[bytes]], count: int, workdir: Path,
                mode: str) -> list[str]:
    """Wait for ``count`` generators on ``client``; a generator that exits first ends the run."""
    import anyio

    while True:
        with anyio.move_on_after(1.0):
            await client.wait_for_generators(count)
            return list(client.coordinator.generators)
        for i, proc in enumerate(procs):
            if proc.poll() is not None:
                raise SystemExit(f"generator {mode} {i} exited with {proc.returncode}:\n"
                                 + (workdir / f"gen-{mode}-{i}.log").read_text()[-2000:])


async def warm_up(client: RolloutClient, weights: dict, version: int, actors: list[str]) -> int:
    """Publish until every generator received a version over its group (groups are built at the
    first collective version); returns the last version published."""
    client.weights_transport = "collective"
    for _ in range(20):
        version += 1
        await client.publish_weights(weights, version, dtype="bfloat16")
        await client.wait_for_version(version, timeout=600)
        if all(client.weights_groups.broadcasts.get(a, 0) for a in actors):
            return version
    raise SystemExit(f"no weights group came up: {client.weights_groups.broadcasts}")


async def publish(client: RolloutClient, weights: dict, version: int, dtype: str, transport: str,
                  actors: list[str]) -> tuple[float, float, int]:
    """One version over ``transport``: ``(total_s, publish_s, generators reached over their group)``."""
    client.weights_transport = transport
    before = sum(client.weights_groups.broadcasts.get(a, 0) for a in actors)
    start = time.perf_counter()
    await client.publish_weights(weights, version, dtype=dtype)
    published = time.perf_counter()
    await client.wait_for_version(version, timeout=600)
    end = time.perf_counter()
    return end - start, published - start, sum(client.weights_groups.broadcasts.get(a, 0) for a in actors) - before


def host_overheads(weights: dict, model: str, bucket_bytes: int) -> dict[tuple[str, str], float]:
    """Seconds, measured here: ``("snapshot", dtype)``, ``("crc32", dtype)``, ``("apply", dtype)``."""
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.protocol.messages import TensorSpec
    from specroll.protocol.weights_layout import WeightsLayout, bucket_checksums

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


def socket_throughput(total_mb: int = 512, frame_mb: int = 64, repeats: int = 5) -> dict[str, float]:
    """MB/s through one ZeroMQ PUSH/PULL connection over loopback TCP, ``none`` and ``curve``
    alternating (median of ``repeats``): the per-byte price of CURVE's encryption alone. Each side
    has its own context (one I/O thread each, as the trainer and a generator have), so encryption
    and decryption run on different threads as they do between processes."""
    import zmq

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    payload = bytes(frame_mb << 20)  # the cipher's cost does not depend on the bytes
    frames = max(1, total_mb // frame_mb)
    times: dict[str, list[float]] = {mode: [] for mode in SECURITY}
    for rep in range(repeats):
        for mode in SECURITY if rep % 2 == 0 else SECURITY[::-1]:
            server_ctx, client_ctx = zmq.Context(io_threads=1), zmq.Context(io_threads=1)
            try:
                pull, push = server_ctx.socket(zmq.PULL), client_ctx.socket(zmq.PUSH)
                if mode == "curve":
                    pull.curve_server, pull.curve_secretkey = True, server_secret
                    push.curve_serverkey, push.curve_publickey, push.curve_secretkey = (
                        server_public, client_public, client_secret)
                push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
                push.send(b"warm-up")
                pull.recv()
                start = time.perf_counter()
                for _ in range(frames):
                    push.send(payload, copy=False)
                for _ in range(frames):
                    pull.recv(copy=False)
                times[mode].append(time.perf_counter() - start)
            finally:
                server_ctx.destroy(linger=0)
                client_ctx.destroy(linger=0)
    return {mode: frames * frame_mb * (1 << 20) / 1e6 / statistics.median(t) for mode, t in times.items()}


def report(rows: list[tuple], overheads: dict, nbytes: dict[str, int], args: argparse.Namespace,
           throughput: dict[int, dict[str, float]] | None) -> None:
    print()
    print(f"publish -> every generator serving it, median of {args.repeats} (bucket {args.bucket_mb} MiB, "
          f"gloo over loopback, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    print(f"{'security':>8} {'gens':>4} {'dtype':>9} {'MB':>6} | {'zmq s':>7} {'MB/s':>6} | {'collective s':>12} "
          f"{'MB/s':>6} | {'zmq/coll':>8} | {'publish s (zmq/coll)':>20}")
    medians: dict[tuple, float] = {}
    bests: dict[tuple, float] = {}
    for count in sorted(args.generators):
        for dtype in DTYPES:
            for mode in args.security:
                mb = nbytes[dtype] / 1e6
                sel = {t: [r for r in rows if r[:4] == (mode, count, dtype, t)] for t in TRANSPORTS}
                med = {t: statistics.median(r[4] for r in sel[t]) for t in TRANSPORTS}
                pub = {t: statistics.median(r[5] for r in sel[t]) for t in TRANSPORTS}
                medians.update({(mode, count, dtype, t): med[t] for t in TRANSPORTS})
                bests.update({(mode, count, dtype, t): min(r[4] for r in sel[t]) for t in TRANSPORTS})
                missed = sum(r[6] < count for r in sel["collective"])
                note = f"  ({missed} collective versions went partly as chunks)" if missed else ""
                print(f"{mode:>8} {count:>4} {dtype:>9} {mb:>6.0f} | {med['zmq']:>7.3f} "
                      f"{mb * count / med['zmq']:>6.0f} | {med['collective']:>12.3f} "
                      f"{mb * count / med['collective']:>6.0f} | {med['zmq'] / med['collective']:>7.2f}x | "
                      f"{pub['zmq']:>9.3f} / {pub['collective']:.3f}{note}")
    if set(SECURITY) <= set(args.security):
        print()
        print("CURVE's cost: curve / none over the same repeats, of the medians (of the fastest):")
        for count in sorted(args.generators):
            for dtype in DTYPES:
                key = (count, dtype)
                ratios = [f"{t} {medians['curve', *key, t] / medians['none', *key, t]:.2f}x "
                          f"({bests['curve', *key, t] / bests['none', *key, t]:.2f}x)" for t in TRANSPORTS]
                print(f"  {count} gen {dtype:>9}: " + ", ".join(ratios))
    for frame_mb, rates in (throughput or {}).items():
        extra_ms = (100 / rates["curve"] - 100 / rates["none"]) * 1e3
        print(f"one ZeroMQ connection over loopback, {frame_mb:>2} MiB frames: none {rates['none']:>5.0f} MB/s, "
              f"curve {rates['curve']:>5.0f} MB/s: CURVE adds {extra_ms:.0f} ms per 100 MB")
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

    from specroll.engine.loaders.checkpoint import load_checkpoint
    from specroll.engine.loaders.registry import DEFAULT_MODEL, resolve_model
    from specroll.engine.model import CausalLM

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
    throughput = ({mb: socket_throughput(frame_mb=mb) for mb in (4, 64)}  # a layer's tensor; a whole chunk
                  if set(SECURITY) <= set(args.security) else None)
    report(rows, overheads, nbytes, args, throughput)


if __name__ == "__main__":
    main()
