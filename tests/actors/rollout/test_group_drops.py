"""A group that keeps failing, over real sockets: a fake generator whose every chunk is refused (token
ids outside the vocabulary) has the group taken from it and resumed, at most ``max_group_retries``
times; then the group is dropped whole, counted by reason, and the client's caller is told
(``GroupDropped``); so is a group whose generators keep vanishing. The client goes on serving."""

from __future__ import annotations

import pytest
from helpers.fake_peers import FakeGenerator, fake_generators
from helpers.timeouts import guard

from specroll.actors import QueueFull  # the embedding API's names
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.telemetry.server_metrics import collect_hub
from specroll.protocol.messages import Abort, Dead, Error, RolloutChunk, SubmitGroup
from specroll.protocol.sampling import SamplingParams
from specroll.rl.group_retries import GroupDropped

pytestmark = pytest.mark.anyio

SAMPLING = SamplingParams(max_tokens=8)
GROUPS_DROPPED = "specroll:groups_dropped"
VOCAB = 100


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def abort_all(gen: FakeGenerator, sub: SubmitGroup) -> None:
    """What a generator does on ``Abort``: end every sample it runs with an ``abort`` chunk."""
    for i in [r.index for r in sub.resume] or range(sub.n):
        await gen.channel.send(RolloutChunk(group_id=sub.group_id, sample_index=i, offset=0, token_ids=[],
                                            logprobs=[], versions=[], finished=True, finish_reason="abort"))


async def test_a_generator_whose_chunks_are_always_refused_gets_its_group_dropped_after_the_retries() -> None:
    async with RolloutClient(heartbeat_timeout_s=60, vocab_size=VOCAB, max_group_retries=2) as client, \
            fake_generators(client.endpoint, "bad-gen") as (bad,):
        await bad.register(free_groups=4, free_seqs=8)
        await client.wait_for_generators(1, timeout=guard(30))
        group_id = await client.submit([5, 6, 7], 2, SAMPLING, payload="answer")
        for _ in range(3):  # the first run and max_group_retries = 2 retries, all on the only generator
            sub = await bad.expect(SubmitGroup)
            assert sub.group_id == group_id
            await bad.stream(group_id, 0, 0, token=VOCAB + 7, count=2)  # outside the vocabulary: refused
            err = await bad.expect(Error)
            assert err.code == "bad_request" and f"[0, {VOCAB})" in err.message
            assert (await bad.expect(Abort)).group_id == group_id
            await abort_all(bad, sub)
        with pytest.raises(GroupDropped) as caught:
            await client.next_finished(timeout=guard(30))
        dropped = caught.value.dropped
        assert (dropped.group_id, dropped.reason, dropped.failures) == (group_id, "refused", 3)
        assert dropped.payload == "answer" and dropped.prompt_token_ids == [5, 6, 7]
        assert "outside" in dropped.detail and "dropped after 3 failures" in str(caught.value)
        assert client.coordinator.groups_dropped == {"refused": 1} and group_id not in client.coordinator.groups
        assert client.pop_dropped() == []  # reported once
        # Prometheus: the hub's drops by reason, plus those its holder made itself (episode groups)
        [family] = [f for f in collect_hub(client, "trainer", "trainer", {"failed": 2}) if f.name == GROUPS_DROPPED]
        assert {m.labels["reason"]: m.value for m in family.samples} == {"refused": 1, "lost": 0, "failed": 2}

        good = await client.submit([8, 9], 1, SAMPLING)  # it goes on serving
        assert (await bad.expect(SubmitGroup)).group_id == good
        await bad.stream(good, 0, 0, token=3, count=4, reason="stop")
        assert (await client.next_finished(timeout=guard(30))).group_id == good
    assert client.num_finished == 0 and client.protocol_errors == 3


async def test_a_group_whose_generators_keep_vanishing_is_dropped_as_lost() -> None:
    async with RolloutClient(heartbeat_timeout_s=60, max_group_retries=1) as client, \
            fake_generators(client.endpoint, "gen-a", "gen-b") as (a, b):
        await a.register()
        await client.wait_for_generators(1, timeout=guard(30))
        group_id = await client.submit([5, 6, 7], 1, SAMPLING)
        assert (await a.expect(SubmitGroup)).group_id == group_id
        await a.stream(group_id, 0, 0, token=11, count=3)
        await a.channel.send(Dead(actor_id="gen-a", reason="killed"))  # its samples are lost
        await b.register()
        sub = await b.expect(SubmitGroup)
        assert sub.group_id == group_id and [r.token_ids for r in sub.resume] == [[11, 11, 11]]  # one retry
        await b.channel.send(Dead(actor_id="gen-b", reason="killed"))  # lost again: past max_group_retries = 1
        with pytest.raises(GroupDropped) as caught:
            await client.wait_finished(1, timeout=guard(30))
    assert caught.value.dropped.reason == "lost" and "generator gen-b is gone" in caught.value.dropped.detail
    assert client.coordinator.groups_dropped == {"lost": 1} and client.coordinator.groups == {}


async def test_submit_past_the_queue_capacity_raises_queue_full_naming_it() -> None:
    async with RolloutClient(max_queued_groups=2) as client:  # no generator: everything stays queued
        first = await client.submit([5], 1, SAMPLING)
        await client.submit([6], 1, SAMPLING, lane="eval")
        with pytest.raises(QueueFull, match=r"max_queued_groups = 2") as caught:
            await client.submit([7], 1, SAMPLING, lane="serve")
        assert caught.value.capacity == 2 and len(client.coordinator.groups) == 2
        await client.abort(first)  # room again
        await client.submit([7], 1, SAMPLING)


async def test_a_training_group_its_generator_refuses_is_resumed_on_another() -> None:
    async with RolloutClient(heartbeat_timeout_s=60) as client, \
            fake_generators(client.endpoint, "small-gen", "big-gen") as (small, big):
        await small.register(free_groups=4, free_seqs=8)
        await big.register(free_groups=4, free_seqs=4)
        await client.wait_for_generators(2, timeout=guard(30))
        group_id = await client.submit([5, 6, 7], 2, SAMPLING)
        assert (await small.expect(SubmitGroup)).group_id == group_id  # the most room
        await small.channel.send(Error(code="bad_request", message="n=2 is over its max_num_seqs", group_id=group_id))
        assert (await big.expect(SubmitGroup)).group_id == group_id
        for i in range(2):
            await big.stream(group_id, i, 0, token=3, count=2, reason="stop")
        group = await client.next_finished(timeout=guard(30))
    assert group.group_id == group_id and group.retries.failures == 1 and group.retries.reason == "refused"
    assert "refused it: n=2 is over its max_num_seqs" in group.retries.detail
