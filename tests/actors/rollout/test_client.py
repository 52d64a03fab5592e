"""The rollout client (the embedding API) against real generator processes: groups stream back,
weights flow out, and a generator killed mid-rollout loses and duplicates nothing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from contextlib import ExitStack
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio
from helpers.processes import generator_process
from helpers.timeouts import guard

from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.sync_client import SyncRolloutClient
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.protocol.codec import encode
from specroll.protocol.messages import AckWeights, FetchWeights, Heartbeat, RolloutChunk
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import close_socket, make_socket

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.integration
async def test_a_killed_generators_groups_finish_elsewhere_from_their_streamed_tokens(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    streamed: dict[tuple[str, int], list[int]] = {}  # (group, sample) -> tokens merged when gen-a was killed
    by_actor: dict[str, set[str]] = {}
    victims: list[str] = []
    gens: dict[str, subprocess.Popen[bytes]] = {}

    def on_chunk(actor: str, chunk: RolloutChunk) -> None:
        by_actor.setdefault(actor, set()).add(chunk.group_id)
        if actor == "gen-a" and not victims and chunk.offset + len(chunk.token_ids) >= 5:
            # Killed in the receive loop as soon as one of its samples has 5 tokens here. gen-a steps
            # only with an empty outbox (max_outbox = 1), so it runs at most a credit window (64 chunks,
            # ~10 steps of its 6 samples) ahead of what this loop read: mid-rollout, however late we are.
            victims.extend(client.coordinator.groups_of("gen-a"))
            for g in victims:
                for i, s in enumerate(client.coordinator.groups[g].samples):
                    streamed[g, i] = list(s.token_ids)
            os.killpg(gens["gen-a"].pid, signal.SIGKILL)

    (tmp_path / "gen-a.toml").write_text("[generator]\nmax_outbox = 1\n")
    sampling = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)
    # Its connection closing, not its silence, tells the client gen-a is gone: the long heartbeat
    # timeout is only there so that a starved gen-b is never declared dead.
    async with RolloutClient(max_groups_in_flight=8, heartbeat_timeout_s=60, on_chunk=on_chunk) as client:
        with ExitStack() as procs:
            for name, extra in (("gen-a", ["--config", str(tmp_path / "gen-a.toml")]), ("gen-b", [])):
                gens[name] = procs.enter_context(generator_process(client.endpoint, model, tmp_path / f"{name}.log",
                                                                   "--stream-every", "1", *extra, actor_id=name))
            await client.wait_for_generators(2, timeout=guard(60))
            groups = [await client.submit([5 + i, 6, 7, 8], 2, sampling) for i in range(6)]
            assert client.coordinator.groups_of("gen-a") and client.coordinator.groups_of("gen-b")
            finished = [await client.next_finished(timeout=guard(90)) for _ in groups]
    assert victims and client.dead_generators == ["gen-a"] and client.coordinator.resumed_groups == len(victims)
    assert sorted(g.group_id for g in finished) == sorted(groups)  # none lost, none twice
    for g in finished:
        for i, s in enumerate(g.samples):
            assert len(s.token_ids) == len(s.logprobs) == len(s.versions) == 60
            if (g.group_id, i) in streamed:  # resumed: begins with exactly what was streamed before
                assert s.token_ids[: len(streamed[g.group_id, i])] == streamed[g.group_id, i]
    assert {g for g in victims} <= by_actor["gen-b"]  # the victims really finished on gen-b


@pytest.mark.integration
def test_sync_client_round_trip_with_a_weight_update(tiny_checkpoint, tmp_path: Path):
    model = tiny_checkpoint("llama")
    weights = load_checkpoint(model).weights
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with SyncRolloutClient(heartbeat_timeout_s=60) as client, \
            generator_process(client.endpoint, model, tmp_path / "gen.log"):
        client.wait_for_generators(1, timeout=guard(60))
        client.submit([5, 6, 7], 2, greedy, payload="x")
        first = client.next_finished(timeout=guard(60))
        assert first.payload == "x" and all(s.versions == [0] * 8 for s in first.samples)
        client.publish_weights(weights, version=3, dtype="float32")
        client.wait_for_version(3, timeout=guard(60))
        with pytest.raises(ValueError, match="not above"):
            client.publish_weights(weights, version=3)
        client.submit([5, 6, 7], 1, greedy)
        second = client.next_finished(timeout=guard(60))
    assert second.samples[0].versions == [3] * 8
    assert second.samples[0].token_ids == first.samples[0].token_ids  # same weights, same greedy tokens


def client_fuzz_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    """Random and corrupted frames from a peer that never said Hello: every one must be refused."""
    valid = [
        RolloutChunk(group_id="g1", sample_index=0, offset=0, token_ids=[1, 2], logprobs=[-1.0, -2.0],
                     versions=[0, 0]),
        Heartbeat(policy_version=0, batch_size=1, free_groups=3, free_seqs=9),
        AckWeights(version=4),
        FetchWeights(version=2),
    ]
    frames = []
    for i in range(n):
        base = [bytes(f) for f in encode(rng.choice(valid), session=rng.randrange(2**62, 2**63),
                                         seq=rng.randrange(1000))]
        header = bytearray(base[0])
        kind = i % 4
        if kind == 0:
            frames.append([rng.randbytes(rng.randrange(0, 64))])
        elif kind == 1:
            frames.append([bytes(header[: rng.randrange(len(header))])])
        elif kind == 2:
            header[rng.randrange(len(header))] ^= 1 << rng.randrange(8)
            frames.append([bytes(header)])
        else:
            frames.append(base)  # well-formed, but from a stranger
    return frames


@pytest.mark.integration
async def test_ten_thousand_bad_frames_never_stop_the_client(tiny_checkpoint, tmp_path):
    """A peer that sends 10,000 random or corrupted messages and never reads a reply: each one is
    refused (counted and logged), and a real generator is served normally afterwards."""
    model = tiny_checkpoint("llama")
    n = 10_000
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    async with RolloutClient(heartbeat_timeout_s=60) as client:
        ctx = zmq.asyncio.Context()
        stranger = make_socket(ctx, zmq.DEALER, connect=client.endpoint, identity=b"stranger", hwm=100)
        try:
            with generator_process(client.endpoint, model, tmp_path / "gen.log"):
                await client.wait_for_generators(1, timeout=guard(60))
                for frames in client_fuzz_frames(random.Random(0), n):
                    await stranger.send_multipart(frames)
                with anyio.fail_after(guard(120)):  # a hang guard: about 10 s on a loaded 2-core machine
                    while client.protocol_errors < n:
                        await anyio.sleep(0.05)
                await client.submit([5, 6, 7], 2, greedy)
                group = await client.next_finished(timeout=guard(60))
        finally:
            close_socket(stranger)
            ctx.term()
    assert client.protocol_errors == n
    assert [len(s.token_ids) for s in group.samples] == [6, 6]
    assert "stranger" not in client.coordinator.generators


async def test_an_unreachable_peer_is_logged_once_per_change_of_state(caplog) -> None:
    """A drafter trainer that died gets ``Capacity`` twice a second until it is declared gone: one
    line when it becomes unreachable (and one when it is back), not one per dropped message."""
    import logging

    from specroll.actors.rollout.outboxes import Outboxes
    from specroll.protocol.channel import Channel
    from specroll.protocol.messages import PROTOCOL_VERSION, Capacity, Hello, ToDrafter, ToTrainer
    from specroll.protocol.sockets import last_endpoint

    def lines(level: int) -> int:
        return sum("drafter-0" in r.getMessage() and "unreachable" in r.getMessage() for r in caplog.records
                   if r.levelno == level)

    async def until(predicate) -> None:
        with anyio.fail_after(guard(30)):
            while not predicate():
                await anyio.sleep(0.02)

    caplog.set_level(logging.DEBUG, "specroll.client")
    ctx = zmq.asyncio.Context()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    channel: Channel = Channel(router, ToTrainer, window=1_000_000)  # never waits for credit here
    dealer = None
    try:
        async with anyio.create_task_group() as tg:
            boxes = Outboxes(channel, tg)
            for _ in range(5):  # never connected: each send is refused by the socket
                boxes.put("drafter-0", Capacity(live_seqs=1, max_seqs=4))
            await until(lambda: lines(logging.INFO) + lines(logging.DEBUG) == 5)
            assert lines(logging.INFO) == 1, caplog.text
            dealer = make_socket(ctx, zmq.DEALER, connect=last_endpoint(router), identity=b"drafter-0")
            peer: Channel = Channel(dealer, ToDrafter)
            await peer.send(Hello(protocol_version=PROTOCOL_VERSION, role="drafter", actor_id="drafter-0"))
            with anyio.fail_after(guard(30)):
                await channel.recv()  # routable from now on
                boxes.put("drafter-0", Capacity(live_seqs=2, max_seqs=4))
                assert (await peer.recv()).msg == Capacity(live_seqs=2, max_seqs=4)
            await until(lambda: "peer drafter-0 is reachable again" in caplog.text)
            close_socket(dealer)
            dealer = None
            with anyio.fail_after(guard(30)):
                while lines(logging.INFO) < 2:  # the close takes effect on the router asynchronously
                    boxes.put("drafter-0", Capacity(live_seqs=3, max_seqs=4))
                    await anyio.sleep(0.05)
            dropped = lines(logging.DEBUG)
            for _ in range(5):
                boxes.put("drafter-0", Capacity(live_seqs=4, max_seqs=4))
            await until(lambda: lines(logging.DEBUG) >= dropped + 5)
            assert lines(logging.INFO) == 2, caplog.text
            tg.cancel_scope.cancel()
    finally:
        if dealer is not None:
            close_socket(dealer)
        close_socket(router)
        ctx.term()


async def test_a_client_cancelled_from_outside_closes_cleanly() -> None:
    """A trainer cancelled by its caller (Ctrl-C in an embedding program, a test's timeout) still
    closes the client: its task group is exited, its sockets and context are closed, and the cancel
    goes on to the caller instead of an error about an unexited cancel scope."""
    started = anyio.Event()
    box: list[RolloutClient] = []

    async def serve() -> None:
        async with RolloutClient(heartbeat_timeout_s=60) as client:
            box.append(client)
            started.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        await started.wait()
        tg.cancel_scope.cancel()
    client = box[0]
    assert client._tg is None and client._socket.ctx is not None and client._socket.ctx.closed
