"""Sockets and the sequenced, credit-flow-controlled channel over real loopback TCP."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

import anyio
import pytest
import torch
import zmq
import zmq.asyncio
from helpers.timeouts import guard

from specroll.protocol.channel import Channel, Received, SequenceError
from specroll.protocol.codec import ProtocolError, encode, pack_tensors
from specroll.protocol.limits import DEFAULT_MAX_FRAME_BYTES
from specroll.protocol.messages import Abort, Heartbeat, RolloutChunk, ToGenerator, ToTrainer, WeightsChunk
from specroll.protocol.sockets import close_socket, last_endpoint, make_socket

pytestmark = pytest.mark.anyio

HANG_S = guard(60)
"""Longest wait for what loopback delivers in milliseconds: a hang guard only. The two short waits
below check that a send *stays* blocked without credit, which no delay can make untrue."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def chunk(i: int) -> RolloutChunk:
    return RolloutChunk(group_id="g", sample_index=0, offset=i, token_ids=[i], logprobs=[-0.5], versions=[0])


@contextlib.asynccontextmanager
async def loopback(window: int = 8, hwm: int = 1000) -> AsyncIterator[tuple[Channel, Channel, zmq.asyncio.Socket]]:
    """(trainer ROUTER channel, generator DEALER channel, the DEALER socket) on a random loopback port."""
    ctx = zmq.asyncio.Context()
    socks: list[zmq.asyncio.Socket] = []
    try:
        router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0", hwm=hwm)
        socks.append(router)
        dealer = make_socket(ctx, zmq.DEALER, connect=last_endpoint(router), hwm=hwm, identity=b"gen-0")
        socks.append(dealer)
        yield Channel(router, ToTrainer, window=window), Channel(dealer, ToGenerator, window=window), dealer
    finally:
        for s in socks:
            close_socket(s)
        ctx.term()


async def drain(ch: Channel, into: list[Received]) -> None:
    """The receive task every channel needs (it consumes credit grants)."""
    while True:
        into.append(await ch.recv())


async def test_sequence_numbers_in_order():
    async with loopback(window=8) as (trainer, gen, _), anyio.create_task_group() as tg:
        tg.start_soon(drain, gen, [])
        seqs: list[int] = []

        async def produce() -> None:
            for i in range(200):  # more than the window: the sender rides on the trainer's credit
                seqs.append(await gen.send(chunk(i)))

        tg.start_soon(produce)
        with anyio.fail_after(HANG_S):
            got = [await trainer.recv() for _ in range(200)]
        assert seqs == list(range(200))
        assert [r.seq for r in got] == list(range(200))
        assert [r.msg.offset for r in got] == list(range(200))
        assert [r.first for r in got] == [True] + [False] * 199
        assert {r.peer for r in got} == {b"gen-0"}
        tg.cancel_scope.cancel()


async def test_recv_reports_idle_moments_while_nothing_arrives_and_loses_nothing():
    """``on_idle`` fires again and again while the socket stays empty (a lone peer's silence is then
    seen by the clock), never while a message waits, and every message sent meanwhile is received."""
    async with loopback() as (trainer, gen, _), anyio.create_task_group() as tg:
        tg.start_soon(drain, gen, [])
        idle: list[float] = []
        got: list[Received] = []

        async def receive() -> None:
            while True:
                got.append(await trainer.recv(on_idle=lambda: idle.append(anyio.current_time()), idle_s=0.01))

        tg.start_soon(receive)
        with anyio.fail_after(HANG_S):
            while len(idle) < 5:  # nothing sent: only the clock moves it
                await anyio.sleep(0.01)
            for i in range(50):
                await gen.send(chunk(i))
                if i % 10 == 0:
                    await anyio.sleep(0.02)
            while len(got) < 50:
                await anyio.sleep(0.01)
        assert [r.msg.offset for r in got] == list(range(50))
        tg.cancel_scope.cancel()


async def test_gap_and_duplicate_are_reported_not_hidden():
    async with loopback() as (trainer, _, dealer):
        for seq in (0, 1, 3, 4, 4, 5):  # 2 lost, 4 twice: written raw, as a broken sender would
            await dealer.send_multipart(encode(chunk(seq), session=7, seq=seq))
        beat = Heartbeat(policy_version=0, batch_size=0, free_groups=0, free_seqs=0)
        await dealer.send_multipart(encode(beat, session=7, seq=8))  # a control message: "8 data messages before me"
        await dealer.send_multipart([b"\xc1garbage"])
        with anyio.fail_after(HANG_S):
            assert [(await trainer.recv()).seq for _ in range(2)] == [0, 1]
            with pytest.raises(SequenceError, match=r"seq 3, expected 2 \(gap: messages 2..2 never arrived\)") as gap:
                await trainer.recv()
            assert (gap.value.peer, gap.value.expected, gap.value.received.msg) == (b"gen-0", 2, chunk(3))
            assert (await trainer.recv()).seq == 4
            with pytest.raises(SequenceError, match="seq 4, expected 5 \\(duplicate\\)"):
                await trainer.recv()
            assert (await trainer.recv()).seq == 5  # the stream goes on
            with pytest.raises(SequenceError, match=r"Heartbeat has seq 8, expected 6 \(gap: messages 6..7"):
                await trainer.recv()  # a lost tail shows on the next control message
            with pytest.raises(ProtocolError, match="malformed") as bad:
                await trainer.recv()
            assert bad.value.peer == b"gen-0"


async def test_credit_blocks_a_sender_beyond_its_window_and_resumes_on_credit():
    window = 4
    async with loopback(window=window) as (trainer, gen, _), anyio.create_task_group() as tg:
        tg.start_soon(drain, gen, [])
        with anyio.fail_after(HANG_S):
            for i in range(window):  # the initial window goes out without any credit
                await gen.send(chunk(i))
        assert not gen.can_send()
        with anyio.move_on_after(0.5) as blocked:
            await gen.send(chunk(window))
        assert blocked.cancelled_caught, "a send beyond the window did not wait for credit"
        await gen.send(Heartbeat(policy_version=0, batch_size=1, free_groups=0, free_seqs=0))  # control: no wait

        sent = anyio.Event()

        async def send_next() -> None:
            await gen.send(chunk(window))
            sent.set()

        tg.start_soon(send_next)
        await anyio.sleep(0.2)
        assert not sent.is_set()
        with anyio.fail_after(HANG_S):
            assert (await trainer.recv()).seq == 0  # consuming grants credit: limit = 1 + window
            await sent.wait()
            got = [(await trainer.recv()).msg for _ in range(window + 1)]
        assert [m.offset for m in got if isinstance(m, RolloutChunk)] == list(range(1, window + 1))
        tg.cancel_scope.cancel()


async def test_slow_trainer_with_small_hwm_gets_every_message():
    n = 300
    async with loopback(window=3, hwm=4) as (trainer, gen, _), anyio.create_task_group() as tg:
        tg.start_soon(drain, gen, [])

        async def produce() -> None:
            for i in range(n):
                ids = list(range(i, i + 256))
                await gen.send(RolloutChunk(group_id="g", sample_index=1, offset=256 * i, token_ids=ids,
                                            logprobs=[-1.0] * 256, versions=[i] * 256))  # fmt: skip

        tg.start_soon(produce)
        got = []
        in_flight = []  # chunks the producer sent that the trainer has not consumed yet
        with anyio.fail_after(HANG_S):
            for i in range(n):
                if i % 10 == 0:
                    await anyio.sleep(0.01)  # a slow consumer
                got.append(await trainer.recv())
                in_flight.append(gen._state(b"").next_seq - len(got))
        assert [r.seq for r in got] == list(range(n))
        assert max(in_flight) <= 3  # memory stays bounded: never more than the window is buffered
        assert [r.msg.token_ids[0] for r in got] == list(range(n))
        tg.cancel_scope.cancel()


async def test_weights_travel_as_frames_to_a_peer():
    async with loopback() as (trainer, gen, _):
        with anyio.fail_after(HANG_S):
            await gen.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=8))
            hello = await trainer.recv()  # the trainer learns the generator's identity
            w = {"embed": torch.randn(16, 8).to(torch.bfloat16), "norm": torch.ones(8)}
            refs, tensors = pack_tensors(w.items())
            await trainer.send(WeightsChunk(version=1, index=0, num_chunks=1, tensors=refs), peer=hello.peer,
                               tensors=tensors)  # fmt: skip
            got = await gen.recv()
        assert got.msg.tensors == refs
        assert all(torch.equal(got.tensors[k].view(torch.uint8), w[k].view(torch.uint8)) for k in w)


async def test_restarted_peer_is_flagged_not_reported_as_duplicate():
    async with loopback(window=4) as (trainer, gen, dealer):
        with anyio.fail_after(HANG_S):
            for i in range(3):
                await gen.send(chunk(i))
            assert [(await trainer.recv()).first for _ in range(3)] == [True, False, False]
            # A new incarnation with the same identity starts again at seq 0: a first message, no duplicate.
            reborn = Channel(dealer, ToGenerator, window=4)
            await reborn.send(chunk(0))
            r = await trainer.recv()
        assert (r.seq, r.first) == (0, True)


async def test_router_refuses_to_send_to_an_unknown_peer():
    async with loopback() as (trainer, _, _):
        with pytest.raises(zmq.ZMQError) as err:
            await trainer.send(Abort(group_id="g"), peer=b"nobody")
        assert err.value.errno == zmq.EHOSTUNREACH
        with pytest.raises(ValueError, match="needs peer="):
            await trainer.send(Abort(group_id="g"))


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://10.1.2.3:5555", "tcp://eth0:0"])
def test_make_socket_refuses_a_public_bind(address):
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match=re.escape(f"refusing to bind '{address}'")):
            make_socket(ctx, zmq.ROUTER, bind=address)
    finally:
        ctx.term()  # would hang if a refused socket were left open


def test_make_socket_options_and_local_binds(tmp_path):
    ctx = zmq.Context()
    try:
        for address in ("tcp://127.0.0.1:0", "tcp://localhost:*", "tcp://[::1]:0", f"ipc://{tmp_path}/t.sock"):
            s = make_socket(ctx, zmq.ROUTER, bind=address, hwm=7)
            try:
                endpoint = last_endpoint(s)
                assert not endpoint.endswith((":0", ":*"))
                assert (s.getsockopt(zmq.SNDHWM), s.getsockopt(zmq.RCVHWM), s.getsockopt(zmq.LINGER)) == (7, 7, 0)
                assert s.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_MAX_FRAME_BYTES
            finally:
                close_socket(s)
        s = make_socket(ctx, zmq.ROUTER, bind="tcp://0.0.0.0:0", allow_public=True)
        close_socket(s)
        s = make_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:9", max_frame_bytes=12345)
        assert s.getsockopt(zmq.MAXMSGSIZE) == 12345
        close_socket(s)
        with pytest.raises(ValueError, match="max_frame_bytes=0"):
            make_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:9", max_frame_bytes=0)
        with pytest.raises(ValueError, match="no PUB/SUB"):
            make_socket(ctx, zmq.PUB, bind="tcp://127.0.0.1:0")
        with pytest.raises(ValueError, match="exactly one of bind= and connect="):
            make_socket(ctx, zmq.DEALER)
        with pytest.raises(ValueError, match="ipc path has"):
            make_socket(ctx, zmq.ROUTER, bind="ipc:///tmp/" + "x" * 120)
    finally:
        ctx.term()
