"""Chunks from a generator that no longer serves their group: one declared dead whose group resumed
elsewhere and which then comes back (a SIGSTOPped process continued), or one still streaming a
group the client aborted. Such chunks never reach the coordinator nor ``on_chunk``, and the group is
aborted on that generator once. Over real sockets, the rollout client fed by fake generators.
"""

from __future__ import annotations

import pytest
from helpers.fake_peers import FakeGenerator, fake_generators
from helpers.timeouts import guard

from specroll.actors.rollout.client import RolloutClient
from specroll.protocol.messages import (
    Abort,
    Dead,
    RolloutChunk,
    SubmitGroup,
)
from specroll.protocol.sampling import SamplingParams

pytestmark = pytest.mark.anyio

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def nothing_else_came(gen: FakeGenerator, marker: str) -> None:
    """No message came to ``gen`` before the answer to a chunk of foreign group ``marker`` (sent now):
    the client answers in order, so no other ``Abort`` is on its way."""
    await gen.stream(marker, 0, 0, 1, 1)
    assert (await gen.expect(Abort)).group_id == marker


async def test_a_generator_back_from_the_dead_has_its_old_group_aborted_and_its_chunks_dropped() -> None:
    seen: list[tuple[str, RolloutChunk]] = []
    async with RolloutClient(heartbeat_timeout_s=60, on_chunk=lambda a, c: seen.append((a, c))) as client, \
            fake_generators(client.endpoint, "gen-a", "gen-b") as (a, b):
        await a.register()
        await client.wait_for_generators(1, timeout=guard(30))
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
        group = await client.next_finished(timeout=guard(30))
        await a.stream(group_id, 1, 3, token=22, count=1)  # after the group finished: dropped, not aborted again
        await nothing_else_came(a, "g-second")
    assert [s.token_ids for s in group.samples] == [[11, 11] + [33] * 6, [33] * 8]
    assert [(actor, c.offset) for actor, c in seen if actor == "gen-a"] == [("gen-a", 0)]  # only the first chunk
    assert all(22 not in c.token_ids for _, c in seen)
    assert client.dead_generators == ["gen-a"] and set(client.coordinator.generators) == {"gen-a", "gen-b"}


async def test_chunks_in_flight_after_the_clients_abort_are_dropped_without_a_second_abort() -> None:
    seen: list[RolloutChunk] = []
    async with RolloutClient(heartbeat_timeout_s=60, on_chunk=lambda _, c: seen.append(c)) as client, \
            fake_generators(client.endpoint, "gen-a") as (a,):
        await a.register()
        await client.wait_for_generators(1, timeout=guard(30))
        group_id = await client.submit([5, 6, 7], 1, SAMPLING)
        assert (await a.expect(SubmitGroup)).group_id == group_id
        await client.abort(group_id)
        assert (await a.expect(Abort)).group_id == group_id
        await a.stream(group_id, 0, 0, token=11, count=2)  # sent before the generator read the Abort
        await a.stream(group_id, 0, 2, token=11, count=0, reason="abort")
        await nothing_else_came(a, "g-marker")
    assert seen == []
