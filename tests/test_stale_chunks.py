"""Chunks from a generator that no longer serves their group: one declared dead whose group resumed
elsewhere and which then comes back (a SIGSTOPped process continued), or one still streaming a
group the client aborted. Such chunks never reach the coordinator nor ``on_chunk``, and the group is
aborted on that generator once. Over real sockets, the rollout client fed by fake generators.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio

from specroll.actors.rollout.client import RolloutClient
from specroll.protocol.channel import Channel
from specroll.protocol.codec import ProtocolError
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Dead,
    Heartbeat,
    Hello,
    RolloutChunk,
    SubmitGroup,
    ToGenerator,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import close_socket, make_socket

pytestmark = pytest.mark.anyio

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Gen:
    """A DEALER channel to the client under ``actor_id``, its messages queued for :meth:`expect`."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, actor_id: str) -> None:
        self.actor_id = actor_id
        self.sock = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=actor_id.encode())
        self.channel: Channel[Any] = Channel(self.sock, ToGenerator)
        self._send, self._recv = anyio.create_memory_object_stream[Any](math.inf)

    async def serve(self) -> None:
        while True:
            with contextlib.suppress(ProtocolError):
                self._send.send_nowait((await self.channel.recv()).msg)

    async def expect(self, kind: type, timeout: float = 30) -> Any:
        with anyio.fail_after(timeout):
            msg = await self._recv.receive()
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r:.300}"
        return msg

    async def register(self) -> None:
        await self.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id=self.actor_id))
        await self.expect(Welcome)
        await self.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))

    async def stream(self, group_id: str, index: int, offset: int, token: int, count: int, reason: str | None = None,
                     ) -> None:
        await self.channel.send(RolloutChunk(group_id=group_id, sample_index=index, offset=offset,
                                             token_ids=[token] * count, logprobs=[-1.0] * count, versions=[0] * count,
                                             finished=reason is not None, finish_reason=reason))


@contextlib.asynccontextmanager
async def generators(endpoint: str, *actor_ids: str) -> AsyncIterator[list[Gen]]:
    ctx = zmq.asyncio.Context()
    gens = [Gen(ctx, endpoint, a) for a in actor_ids]
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


async def nothing_else_came(gen: Gen, marker: str) -> None:
    """No message came to ``gen`` before the answer to a chunk of foreign group ``marker`` (sent now):
    the client answers in order, so no other ``Abort`` is on its way."""
    await gen.stream(marker, 0, 0, 1, 1)
    assert (await gen.expect(Abort)).group_id == marker


async def test_a_generator_back_from_the_dead_has_its_old_group_aborted_and_its_chunks_dropped() -> None:
    seen: list[tuple[str, RolloutChunk]] = []
    async with RolloutClient(heartbeat_timeout_s=60, on_chunk=lambda a, c: seen.append((a, c))) as client, \
            generators(client.endpoint, "gen-a", "gen-b") as (a, b):
        await a.register()
        await client.wait_for_generators(1, timeout=30)
        group_id = await client.submit([5, 6, 7], 2, SAMPLING)
        assert (await a.expect(SubmitGroup)).group_id == group_id
        await a.stream(group_id, 0, 0, token=11, count=2)
        await a.channel.send(Dead(actor_id="gen-a", reason="declared dead"))  # as if silent past the timeout
        await b.register()
        resumed = await b.expect(SubmitGroup)
        assert resumed.group_id == group_id and [list(r.token_ids) for r in resumed.resume] == [[11, 11], []]

        await a.register()  # back: it still decodes its old group, with other tokens
        await a.stream(group_id, 0, 0, token=22, count=4)
        assert (await a.expect(Abort)).group_id == group_id
        await a.stream(group_id, 1, 0, token=22, count=3)  # more stale chunks: no second Abort
        await a.stream(group_id, 0, 4, token=22, count=1, reason="abort")
        await nothing_else_came(a, "g-first")

        await b.stream(group_id, 0, 2, token=33, count=6, reason="length")
        await b.stream(group_id, 1, 0, token=33, count=8, reason="length")
        group = await client.next_finished(timeout=30)
        await a.stream(group_id, 1, 3, token=22, count=1)  # after the group finished: dropped, not aborted again
        await nothing_else_came(a, "g-second")
    assert [s.token_ids for s in group.samples] == [[11, 11] + [33] * 6, [33] * 8]
    assert [(actor, c.offset) for actor, c in seen if actor == "gen-a"] == [("gen-a", 0)]  # only the first chunk
    assert all(22 not in c.token_ids for _, c in seen)
    assert client.dead_generators == ["gen-a"] and set(client.coordinator.generators) == {"gen-a", "gen-b"}


async def test_chunks_in_flight_after_the_clients_abort_are_dropped_without_a_second_abort() -> None:
    seen: list[RolloutChunk] = []
    async with RolloutClient(heartbeat_timeout_s=60, on_chunk=lambda _, c: seen.append(c)) as client, \
            generators(client.endpoint, "gen-a") as (a,):
        await a.register()
        await client.wait_for_generators(1, timeout=30)
        group_id = await client.submit([5, 6, 7], 1, SAMPLING)
        assert (await a.expect(SubmitGroup)).group_id == group_id
        await client.abort(group_id)
        assert (await a.expect(Abort)).group_id == group_id
        await a.stream(group_id, 0, 0, token=11, count=2)  # sent before the generator read the Abort
        await a.stream(group_id, 0, 2, token=11, count=0, reason="abort")
        await nothing_else_came(a, "g-marker")
    assert seen == []
