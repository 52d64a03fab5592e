"""Bounded work from a generator: the rollout client checks every count and size a generator's message
carries against a limit before any work is done for it, answers with an ``Error`` naming the field,
the value and the limit, and goes on serving. Well-formed messages with extreme values from a fake
generator over a real socket (the generator's own bounds: ``test_generator_bounds.py``)."""

from __future__ import annotations

import contextlib
import math

import anyio
import pytest
from helpers.fake_peers import fake_generator
from helpers.timeouts import guard

from specroll.actors.rollout.client import RolloutClient
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    Heartbeat,
    Hello,
    RolloutChunk,
    Stats,
    SubmitGroup,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def chunk(group_id: str, index: int, tokens: int, offset: int = 0, finished: bool = False) -> RolloutChunk:
    return RolloutChunk(group_id=group_id, sample_index=index, offset=offset, token_ids=[1] * tokens,
                        logprobs=[-1.0] * tokens, versions=[0] * tokens, finished=finished,
                        finish_reason="length" if finished else None)


async def test_the_client_refuses_chunks_past_max_tokens_and_bad_group_ids_and_keeps_serving() -> None:
    async with RolloutClient(heartbeat_timeout_s=30) as client, fake_generator(client.endpoint) as gen:
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        # Extreme but well-formed statistics are harmless: taken as they are.
        await gen.channel.send(Stats(policy_version=2**63 - 1, num_steps=2**64 - 1, num_tokens=2**64 - 1,
                                     busy_s=math.inf, idle_s=-1.0))
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=2**64 - 1, free_seqs=2**64 - 1))
        err = await gen.expect(Error)
        assert err.code == "bad_request" and "Heartbeat.free_seqs" in err.message and str(2**64 - 1) in err.message
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        group_id = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))
        sub = await gen.expect(SubmitGroup)
        assert sub.group_id == group_id

        await gen.channel.send(chunk(group_id, 0, 10**6))
        err = await gen.expect(Error)
        assert err.code == "bad_request" and "len(token_ids) = 1000000" in err.message and "limit 8" in err.message
        assert (await gen.expect(Abort)).group_id == group_id  # taken from it, to resume (rl/group_retries.py)
        await gen.channel.send(chunk("g" + "1" * 5000, 0, 1))  # int() of it would raise
        err = await gen.expect(Error)
        assert err.code == "bad_request" and "len(group_id) = 5001" in err.message
        await gen.channel.send(chunk("g²", 0, 1))  # a digit int() does not read: foreign, aborted
        assert (await gen.expect(Abort)).group_id == "g²"

        for i in range(2):  # the Abort ends both samples there; then it gets the group again
            await gen.channel.send(RolloutChunk(group_id=group_id, sample_index=i, offset=0, token_ids=[], logprobs=[],
                                                versions=[], finished=True, finish_reason="abort"))
        sub = await gen.expect(SubmitGroup)
        assert sub.group_id == group_id and sub.resume == ()  # nothing of it was kept
        await gen.channel.send(chunk(group_id, 0, 8, finished=True))
        await gen.channel.send(chunk(group_id, 1, 8, finished=True))
        group = await client.next_finished(timeout=guard(30))
    assert group.group_id == group_id and [len(s.token_ids) for s in group.samples] == [8, 8]
    assert group.retries.failures == 1 and group.dispatches == 2


async def test_a_frame_over_the_clients_cap_is_dropped_unread_and_the_generator_goes_on() -> None:
    """A chunk whose frame is over the client's ``max_frame_bytes`` never reaches the codec: the
    socket drops that connection before reading the frame's body (``MAXMSGSIZE``). The generator's
    connection comes back by itself, its next message shows the lost one as a sequence gap, and it
    is told to register again; nothing of the chunk is held."""
    async with RolloutClient(heartbeat_timeout_s=60, max_frame_bytes=1 << 20) as client, \
            fake_generator(client.endpoint) as gen:
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        group_id = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))
        assert (await gen.expect(SubmitGroup)).group_id == group_id
        await gen.channel.send(chunk(group_id, 0, 200_000))  # a 2 MB frame
        with anyio.fail_after(guard(60)):
            while True:  # a heartbeat carries the next number: the first that gets through shows the gap
                await gen.channel.send(Heartbeat(policy_version=0, batch_size=1, free_groups=0, free_seqs=3))
                with contextlib.suppress(TimeoutError):
                    err = await gen.expect(Error, timeout=0.2)
                    break
        assert err.code == "unknown_peer" and "never arrived" in err.message, err
        assert [len(s.token_ids) for s in client.coordinator.groups[group_id].samples] == [0, 0]
        assert client.coordinator.groups[group_id].generator is None  # queued again


async def test_a_generator_whose_messages_were_lost_registers_again_and_its_groups_resume() -> None:
    """A connection that dropped and came back (a trainer paused past the ZeroMQ heartbeat) loses
    what was in flight: the next message shows a sequence gap. The generator's groups would wait
    forever for chunks no one resends, so the client treats it as gone (its groups resume from the
    tokens held) and answers ``unknown_peer``; after ``Hello`` it gets them back as resumes."""
    async with RolloutClient(heartbeat_timeout_s=60) as client, fake_generator(client.endpoint) as gen:
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        group_id = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))
        assert (await gen.expect(SubmitGroup)).group_id == group_id
        await gen.channel.send(chunk(group_id, 0, 3))
        gen.channel._state(gen.channel._key(None)).next_seq += 5  # five messages lost on the way
        await gen.channel.send(chunk(group_id, 0, 4, offset=3))  # held: 3 tokens; these 4 would leave a gap
        err = await gen.expect(Error)
        assert err.code == "unknown_peer" and "never arrived" in err.message, err
        assert client.coordinator.groups[group_id].generator is None  # queued again, to resume

        gen.channel.forget()  # what the generator does on unknown_peer: a new session, then Hello
        await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
        await gen.expect(Welcome)
        await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=4))
        sub = await gen.expect(SubmitGroup)
        assert sub.group_id == group_id and [len(r.token_ids) for r in sub.resume if r.index == 0] == [3]


async def test_a_generator_the_client_cannot_route_to_is_declared_gone_at_once() -> None:
    """A message for a peer whose connection is gone cannot be routed (``EHOSTUNREACH``) and is
    dropped. It may carry a group the client would then wait for without end (a chaos run hung so),
    so the peer is declared gone there and then — not after the disconnect grace, here 600 s — and
    its groups queue again to resume elsewhere."""
    async with RolloutClient(heartbeat_timeout_s=600, disconnect_grace_s=600) as client:
        async with fake_generator(client.endpoint) as gen:
            await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))
            await gen.expect(Welcome)
            await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=2, free_seqs=8))
            first = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))
            assert (await gen.expect(SubmitGroup)).group_id == first
        with anyio.fail_after(guard(30)):  # its connection closed: the monitor reports it
            while client.peers.liveness._peers["fake-gen"].closed_at is None:
                await anyio.sleep(0.02)
        second = await client.submit([5, 6, 7], 2, SamplingParams(max_tokens=8))  # sent to it: unroutable
        with anyio.fail_after(guard(30)):
            while "fake-gen" in client.coordinator.generators:
                await anyio.sleep(0.02)
        assert client.peers.dead_generators == ["fake-gen"]
        assert all(client.coordinator.groups[g].generator is None for g in (first, second))  # queued again
