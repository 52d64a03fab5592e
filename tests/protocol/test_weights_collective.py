"""Policy weights over torch.distributed weights groups (``network.weights_transport = "collective"``).

Function level (both ends in this process, gloo over loopback): a version's bytes arrive
bit-identical, a corrupted bucket is named, a generator that dies mid-broadcast fails the send.
Actor level: the real :class:`RolloutClient` here and real generator processes
(``python -m specroll.actors.generator``) on a tiny random checkpoint: a version served over the
group decodes exactly like a local engine holding the published weights, a corrupted bucket is
refused and not applied, and a generator killed and restarted gets a new group and serves the
next version while the other keeps its own. Every process is killed and reaped on the way out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
import torch
from helpers.checkpoints import write_tiny_checkpoint
from helpers.processes import generator_process
from helpers.timeouts import guard

from specroll.actors.peer.weights_fetch import check_announcement
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.weights_publish import PublishedWeights
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.protocol.limits import LimitExceeded
from specroll.protocol.messages import TensorSpec
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.weights_collective import (
    ChecksumMismatch,
    CollectiveError,
    build_group,
    in_daemon_thread,
    open_store,
    receive_buckets,
    send_buckets,
)
from specroll.protocol.weights_layout import WeightsLayout, bucket_checksums

HANG_S = guard(90)
"""Longest wait for one event: only a hang guard, never what a test checks."""
KV_GB = 0.02
PROMPT = [5, 17, 42, 9, 77, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def random_named(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}


# ---- function level -------------------------------------------------------------------------


def pair(timeout_s: float = 30.0):
    """Both ends of a gloo weights group in this process (rank 1 built in a thread)."""
    store = open_store("127.0.0.1", timeout_s)
    ends = {}
    t = threading.Thread(target=lambda: ends.update(
        one=build_group("w", "gloo", 1, "127.0.0.1", timeout_s, None, store.port)))
    t.start()
    zero = build_group("w", "gloo", 0, "127.0.0.1", timeout_s, store)
    t.join()
    return zero, ends["one"]


def transfer(zero, one, layout: WeightsLayout, flat: torch.Tensor, bucket_bytes: int, checksums: list[int]):
    out: dict[str, object] = {}

    def receive() -> None:
        try:
            out["tensors"] = receive_buckets(one, layout, bucket_bytes, checksums)
        except (ChecksumMismatch, CollectiveError) as e:
            out["error"] = e

    t = threading.Thread(target=receive)
    t.start()
    send_buckets(zero, flat, bucket_bytes)
    t.join()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_version_arrives_bit_identical_across_buckets(dtype: str) -> None:
    named = {"a": torch.randn(300, 7), "b": torch.randn(5), "empty": torch.randn(0, 3), "c": torch.randn(1000, 33)}
    named["a"][0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])  # odd bit patterns travel too
    layout = WeightsLayout.of([TensorSpec(name=n, shape=tuple(t.shape)) for n, t in named.items()], dtype)
    flat = layout.flatten(named)
    bucket_bytes = 4096  # many buckets; tensors span them
    sums = bucket_checksums(flat, bucket_bytes)
    assert len(sums) == -(-layout.total_bytes // bucket_bytes) > 10
    zero, one = pair()
    out = transfer(zero, one, layout, flat, bucket_bytes, sums)
    got = out["tensors"]
    assert isinstance(got, dict) and list(got) == list(named)
    for name, t in named.items():
        sent = t.to(layout.dtype)
        assert got[name].dtype == sent.dtype and got[name].shape == sent.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)), name


def test_a_corrupted_bucket_is_named_and_the_group_stays_in_step() -> None:
    named = {"w": torch.randn(64, 64), "v": torch.randn(64)}
    layout = WeightsLayout.of([TensorSpec(name=n, shape=tuple(t.shape)) for n, t in named.items()], "float32")
    flat = layout.flatten(named)
    sums = bucket_checksums(flat, 4096)
    zero, one = pair()
    corrupted = flat.clone()
    corrupted[5000] ^= 1  # one bit of bucket 1
    out = transfer(zero, one, layout, corrupted, 4096, sums)
    assert isinstance(out.get("error"), ChecksumMismatch) and "bucket 1 " in str(out["error"])
    out = transfer(zero, one, layout, flat, 4096, sums)  # the next version still arrives
    assert torch.equal(out["tensors"]["w"], named["w"])  # type: ignore[index]


_DYING_MEMBER = """
import sys, time
from specroll.protocol.weights_collective import build_group
end = build_group("w", "gloo", 1, "127.0.0.1", float(sys.argv[2]), None, int(sys.argv[1]))
print("joined", flush=True)
time.sleep(3600)  # never receives: the test kills it
"""


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_member_killed_mid_broadcast_fails_the_send_instead_of_hanging(tmp_path: Path) -> None:
    timeout_s = 600.0  # far beyond the hang guard: the send must fail because the member died
    store = open_store("127.0.0.1", timeout_s)
    child = subprocess.Popen([sys.executable, "-c", _DYING_MEMBER, str(store.port), str(timeout_s)],
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        zero = await in_daemon_thread(build_group, "w", "gloo", 0, "127.0.0.1", timeout_s, store)
        assert child.stdout is not None and child.stdout.readline().strip() == b"joined"
        flat = torch.zeros(8 << 20, dtype=torch.uint8)  # [8 MiB]

        async def kill_soon() -> None:
            await anyio.sleep(0.5)  # most likely mid-send; either way the send must fail, not hang
            os.killpg(child.pid, signal.SIGKILL)

        with anyio.fail_after(HANG_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_soon)
                with pytest.raises(CollectiveError, match="broadcast failed"):
                    await in_daemon_thread(send_buckets, zero, flat, 1 << 20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=guard(30))


def test_a_collective_announcement_is_bounded_by_the_model() -> None:
    shapes = {"w": (4, 8), "v": (8,)}
    published = PublishedWeights("collective", bucket_bytes=64)
    a = published.publish({n: torch.ones(s) for n, s in shapes.items()}, 1, "float32")
    assert a.transport == "collective" and len(a.bucket_checksums) == 3  # 160 bytes in 64-byte buckets
    check_announcement(a, shapes)
    with pytest.raises(LimitExceeded, match="shape"):
        check_announcement(a, {"w": (4, 9), "v": (8,)})
    with pytest.raises(LimitExceeded, match="bucket_checksums"):
        check_announcement(type(a)(**{**{f: getattr(a, f) for f in a.__struct_fields__},
                                      "bucket_checksums": a.bucket_checksums[:2]}), shapes)
    with pytest.raises(LimitExceeded, match="bucket_bytes"):
        check_announcement(type(a)(**{**{f: getattr(a, f) for f in a.__struct_fields__}, "bucket_bytes": 0}),
                           shapes)


# ---- actor level: the real client and real generator processes -----------------------------


@contextlib.asynccontextmanager
async def collective_client() -> AsyncIterator[RolloutClient]:
    async with RolloutClient("tcp://127.0.0.1:0", heartbeat_timeout_s=60.0, weights_transport="collective",
                             weights_bucket_mb=1) as client:
        yield client


def start_generator(client: RolloutClient, model: Path, tmp_path: Path, actor_id: str, log_name: str = ""):
    config = tmp_path / "collective.toml"
    config.write_text('[network]\nweights_transport = "collective"\n')
    return generator_process(client.endpoint, model, tmp_path / f"{log_name or actor_id}.log", "--config",
                             str(config), actor_id=actor_id, kv_gb=KV_GB)


async def wait_for(predicate: Callable[[], bool], what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    with anyio.fail_after(HANG_S):
        while not predicate():
            for p in procs:
                assert p.poll() is None, f"a generator exited with {p.returncode} while waiting for {what}"
            await anyio.sleep(0.05)


class Publisher:
    """Publishes numbered random versions of the model's weights (float32 on the wire)."""

    def __init__(self, client: RolloutClient, shapes: dict[str, tuple[int, ...]]) -> None:
        self.client, self.shapes, self.version = client, shapes, 0
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    async def publish(self) -> int:
        self.version += 1
        self.weights[self.version] = random_named(self.version, self.shapes)
        await self.client.publish_weights(self.weights[self.version], self.version, dtype="float32")
        return self.version

    async def until_broadcast(self, actors: list[str], procs: list[subprocess.Popen[bytes]]) -> int:
        """Publish versions until each of ``actors`` received one more over its group; the first
        versions go as chunks while the groups are being built. Returns the last version."""
        before = {a: self.client.weights_groups.broadcasts.get(a, 0) for a in actors}
        for _ in range(6):
            v = await self.publish()
            await wait_for(lambda v=v: all(self.client.generator_versions.get(a, -1) >= v for a in actors),
                           f"version {v} served", procs)
            if all(self.client.weights_groups.broadcasts.get(a, 0) > before[a] for a in actors):
                return v
        raise AssertionError(f"no broadcast to {actors} in 6 versions: {self.client.weights_groups.broadcasts}")


def greedy_locally(model: Path, weights: dict[str, torch.Tensor]) -> tuple[list[int], list[float]]:
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=KV_GB))
    engine.update_weights(weights, 1)
    engine.add_request(PROMPT, GREEDY, "ref")
    done = run_to_completion(engine)["ref"]
    return done.token_ids, done.logprobs


async def greedy_remotely(client: RolloutClient) -> tuple[list[int], list[float], list[int]]:
    await client.submit(PROMPT, n=1, sampling=GREEDY)
    group = await client.next_finished(timeout=HANG_S)
    s = group.samples[0]
    return list(s.token_ids), list(s.logprobs), list(s.versions)


def tiny_model(tmp_path: Path) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """A tiny Llama of about 6 MiB in float32, so a version spans several 1 MiB buckets."""
    path = tmp_path / "tiny"
    path.mkdir()
    model = write_tiny_checkpoint(path, "llama", hidden_size=128, intermediate_size=1024, num_attention_heads=4)
    return path, {n: tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.anyio
async def test_collective_versions_decode_like_the_published_weights_and_a_corrupted_one_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, shapes = tiny_model(tmp_path)
    caplog.set_level(logging.WARNING, logger="specroll.client")
    async with collective_client() as client:
        with start_generator(client, model, tmp_path, "gen-0") as proc:
            await client.wait_for_generators(1, timeout=HANG_S)
            publisher = Publisher(client, shapes)
            v = await publisher.until_broadcast(["gen-0"], [proc])
            tokens, logprobs, versions = await greedy_remotely(client)
            want_tokens, want_logprobs = greedy_locally(model, publisher.weights[v])
            assert versions == [v] * len(tokens)
            assert tokens == want_tokens
            assert logprobs == pytest.approx(want_logprobs, abs=1e-5)

            # Corrupt the next version's bytes after its checksums were taken (before any fetch
            # can be read: nothing awaits in between), then publish a good one.
            bad = await publisher.publish()
            flat = client._weights.latest_bytes(bad)
            assert flat is not None
            flat[flat.numel() // 2] ^= 0x10
            await wait_for(lambda: any(f"policy version {bad} refused" in r.getMessage() for r in caplog.records),
                           "the refusal", [proc])
            assert "CRC-32" in next(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
            assert client.generator_versions["gen-0"] == v, "the corrupted version was applied"
            good = await publisher.until_broadcast(["gen-0"], [proc])
            tokens, _, versions = await greedy_remotely(client)
            assert versions == [good] * len(tokens)
            assert tokens == greedy_locally(model, publisher.weights[good])[0]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.anyio
async def test_a_restarted_generator_gets_a_new_group_and_the_other_keeps_its_own(tmp_path: Path) -> None:
    model, shapes = tiny_model(tmp_path)
    async with collective_client() as client:
        groups = client.weights_groups
        with start_generator(client, model, tmp_path, "gen-0") as gen0:
            with start_generator(client, model, tmp_path, "gen-1") as gen1:
                await client.wait_for_generators(2, timeout=HANG_S)
                publisher = Publisher(client, shapes)
                await publisher.until_broadcast(["gen-0", "gen-1"], [gen0, gen1])
                name0, old1 = groups.group_name("gen-0"), groups.group_name("gen-1")
                assert name0 is not None and old1 is not None and name0 != old1
                os.killpg(gen1.pid, signal.SIGKILL)
                await anyio.to_thread.run_sync(gen1.wait)
                await wait_for(lambda: "gen-1" in client.dead_generators, "gen-1 declared gone", [gen0])
                assert groups.group_name("gen-1") is None, "the dead generator's group was kept"
                await publisher.until_broadcast(["gen-0"], [gen0])  # unaffected meanwhile
            with start_generator(client, model, tmp_path, "gen-1", "gen-1-restarted") as gen1:
                await client.wait_for_generators(2, timeout=HANG_S)
                await publisher.until_broadcast(["gen-0", "gen-1"], [gen0, gen1])
                new1 = groups.group_name("gen-1")
                assert new1 is not None and new1 not in (old1, name0)
                assert groups.group_name("gen-0") == name0, "gen-0's group was rebuilt"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.anyio
async def test_a_group_that_cannot_be_opened_falls_back_to_chunks_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, shapes = tiny_model(tmp_path)
    caplog.set_level(logging.WARNING, logger="specroll.client")
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the trainer cannot listen there.
    async with RolloutClient("tcp://127.0.0.1:0", heartbeat_timeout_s=60.0, weights_transport="collective",
                             weights_bucket_mb=1, weights_host="192.0.2.1") as client:
        with start_generator(client, model, tmp_path, "gen-0") as proc:
            await client.wait_for_generators(1, timeout=HANG_S)
            publisher = Publisher(client, shapes)
            for _ in range(3):
                v = await publisher.publish()
                await wait_for(lambda v=v: client.generator_versions.get("gen-0", -1) >= v, f"version {v}", [proc])
            tokens, _, versions = await greedy_remotely(client)
            assert versions == [v] * len(tokens) and tokens == greedy_locally(model, publisher.weights[v])[0]
    assert client.weights_groups.broadcasts == {}
    failed = [r for r in caplog.records if "weights group with gen-0 failed" in r.getMessage()]
    assert len(failed) == 1 and "192.0.2.1" in failed[0].getMessage()
    assert (tmp_path / "gen-0.log").read_text().count("weights group unusable") == 1
