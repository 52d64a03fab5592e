"""Fake peers on real sockets: a trainer (a ROUTER channel) that a generator or drafter trainer
process connects to, and a generator (a DEALER channel) that connects to a rollout client."""

from __future__ import annotations

import contextlib
import math
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import anyio
import torch
import zmq
import zmq.asyncio

from helpers.timeouts import guard
from specroll.protocol.channel import Channel, Received
from specroll.protocol.codec import ProtocolError
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    FinishReason,
    Heartbeat,
    Hello,
    RolloutChunk,
    Stats,
    ToGenerator,
    ToTrainer,
    Welcome,
)
from specroll.protocol.sockets import close_socket, last_endpoint, make_socket

PEER = b"gen-0"
"""The generator a :class:`FakeTrainer` talks to (``generator_process``'s default actor id)."""
HANG_S = guard(60)
"""Longest wait for one message: only a hang guard, never what a test checks."""
LONG_CONTEXT = 4096
"""Positions of the models whose rollouts must still be running when the test acts (an ``Abort``, a
weight update): their budgets are thousands of tokens, far more than a generator makes while a
starved test process is late, so the action always lands mid-rollout; the test then aborts them."""


# ---- the fake trainer -----------------------------------------------------------------------


class FakeTrainer:
    """A ROUTER channel on a random loopback port with its receive task; heartbeats and stats are
    kept aside, every other message is queued for :meth:`next`."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
        self.endpoint = last_endpoint(self.sock)
        self.channel: Channel[Any] = Channel(self.sock, ToTrainer)
        self._send, self._recv = anyio.create_memory_object_stream[Any](math.inf)
        self.heartbeats: list[Heartbeat] = []
        self.stats: list[Stats] = []
        self.bad: list[ProtocolError] = []

    async def serve(self) -> None:
        while True:
            try:
                r: Received[Any] = await self.channel.recv()
            except ProtocolError as e:
                self.bad.append(e)
                continue
            if isinstance(r.msg, Heartbeat):
                self.heartbeats.append(r.msg)
            elif isinstance(r.msg, Stats):
                self.stats.append(r.msg)
            else:
                self._send.send_nowait(r.msg)

    async def next(self, timeout: float = HANG_S) -> Any:
        with anyio.fail_after(timeout):
            return await self._recv.receive()

    async def expect(self, kind: type, timeout: float = HANG_S) -> Any:
        msg = await self.next(timeout)
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r:.300}"
        return msg

    async def send(self, msg: Any, tensors: list[torch.Tensor] | None = None) -> None:
        await self.channel.send(msg, peer=PEER, tensors=tensors or ())

    def lose(self, count: int) -> None:
        """Number the next ``count`` messages to the generator as sent, and send none: what a ROUTER
        does to messages for a peer whose connection is gone."""
        self.channel._state(PEER).next_seq += count

    async def next_heartbeat(self, count: int = 1, timeout: float = HANG_S) -> Heartbeat:
        """The ``count``-th heartbeat that arrives from now on. The generator sleeps ``--heartbeat-s``
        between two, so ``count`` of them span at least ``count - 1`` intervals of its own running
        time, however late this process reads them."""
        seen = len(self.heartbeats)
        with anyio.fail_after(timeout):
            while len(self.heartbeats) < seen + count:
                await anyio.sleep(0.02)
        return self.heartbeats[seen + count - 1]

    async def handshake(self) -> Hello:
        hello = await self.expect(Hello)
        assert (hello.role, hello.protocol_version, hello.actor_id) == ("generator", PROTOCOL_VERSION, "gen-0")
        await self.send(Welcome(protocol_version=PROTOCOL_VERSION, actor_id="trainer"))
        return hello


@contextlib.asynccontextmanager
async def fake_trainer() -> AsyncIterator[FakeTrainer]:
    ctx = zmq.asyncio.Context()
    trainer = FakeTrainer(ctx)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.serve)
            yield trainer
            tg.cancel_scope.cancel()
    finally:
        close_socket(trainer.sock)
        ctx.term()


async def wait_exit(proc: subprocess.Popen[bytes], timeout: float = HANG_S) -> int:
    return await anyio.to_thread.run_sync(proc.wait, timeout)


async def collect(trainer: FakeTrainer, group_id: str, indices: set[int], first_offset: int = 0,
                  others: list[Any] | None = None, prior: list[Any] = ()) -> dict[int, list[RolloutChunk]]:
    """Chunks of ``group_id`` (``prior`` messages first, then received ones) until each sample in
    ``indices`` finished; checks offsets are contiguous. Other messages go to ``others``."""
    chunks: dict[int, list[RolloutChunk]] = {i: [] for i in indices}
    offsets = dict.fromkeys(indices, first_offset)
    pending = list(prior)
    while any(not c or not c[-1].finished for c in chunks.values()):
        msg = pending.pop(0) if pending else await trainer.next()
        if not isinstance(msg, RolloutChunk) or msg.group_id != group_id:
            assert others is not None, f"unexpected message {msg!r:.300}"
            others.append(msg)
            continue
        i = msg.sample_index
        assert i in chunks and not (chunks[i] and chunks[i][-1].finished), f"chunk after the last: {msg}"
        assert msg.offset == offsets[i], f"sample {i}: offset {msg.offset}, expected {offsets[i]}"
        offsets[i] += len(msg.token_ids)
        chunks[i].append(msg)
    return chunks


def joined(chunks: list[RolloutChunk]) -> tuple[list[int], list[int]]:
    return [t for c in chunks for t in c.token_ids], [v for c in chunks for v in c.versions]


# ---- the fake generator ---------------------------------------------------------------------


class FakeGenerator:
    """A DEALER channel to a rollout client under ``actor_id``, with its receive task; messages are
    queued for :meth:`expect`."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, actor_id: str = "fake-gen") -> None:
        self.actor_id = actor_id
        self.sock = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=actor_id.encode())
        self.channel: Channel[Any] = Channel(self.sock, ToGenerator)
        self._send, self._recv = anyio.create_memory_object_stream[Any](math.inf)

    async def serve(self) -> None:
        while True:
            with contextlib.suppress(ProtocolError):
                self._send.send_nowait((await self.channel.recv()).msg)

    async def expect(self, kind: type, timeout: float = guard(30)) -> Any:
        with anyio.fail_after(timeout):
            msg = await self._recv.receive()
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r:.300}"
        return msg

    async def register(self, free_groups: int = 1, free_seqs: int = 4) -> None:
        """Say ``Hello``, wait for ``Welcome``, report capacity (a heartbeat)."""
        await self.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id=self.actor_id))
        await self.expect(Welcome)
        await self.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=free_groups,
                                          free_seqs=free_seqs))

    async def stream(self, group_id: str, index: int, offset: int, token: int, count: int,
                     reason: FinishReason | None = None) -> None:
        """Send ``count`` copies of ``token`` for sample ``index`` at ``offset`` (the last with ``reason``)."""
        await self.channel.send(RolloutChunk(group_id=group_id, sample_index=index, offset=offset,
                                             token_ids=[token] * count, logprobs=[-1.0] * count, versions=[0] * count,
                                             finished=reason is not None, finish_reason=reason))


@contextlib.asynccontextmanager
async def fake_generators(endpoint: str, *actor_ids: str) -> AsyncIterator[list[FakeGenerator]]:
    """Fake generators connected to ``endpoint``, one per actor id, each receiving."""
    ctx = zmq.asyncio.Context()
    gens = [FakeGenerator(ctx, endpoint, actor_id) for actor_id in actor_ids]
    try:
        async with anyio.create_task_group() as tg:
            for gen in gens:
                tg.start_soon(gen.serve)
            yield gens
            tg.cancel_scope.cancel()
    finally:
        for gen in gens:
            close_socket(gen.sock)
        ctx.term()


@contextlib.asynccontextmanager
async def fake_generator(endpoint: str) -> AsyncIterator[FakeGenerator]:
    """One fake generator, ``fake-gen``."""
    async with fake_generators(endpoint, "fake-gen") as (gen,):
        yield gen
