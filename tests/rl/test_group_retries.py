"""The retry rule in the coordinator: a group whose samples are refused or lost is resumed elsewhere
from the tokens held, at most ``max_group_retries`` times; one failure more drops it whole (never
emitted partial, counted by reason, handed to its submitter); and the bound on queued groups."""

from __future__ import annotations

import re

import pytest

from specroll.protocol.messages import RolloutChunk
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import ChunkError, Group, QueueFull, RolloutCoordinator
from specroll.rl.group_retries import GroupRetries

SAMPLING = SamplingParams(temperature=1.0, max_tokens=32)


def chunk(group: str, index: int, offset: int, tokens: list[int], finish: str | None = None) -> RolloutChunk:
    return RolloutChunk(group_id=group, sample_index=index, offset=offset, token_ids=tokens,
                        logprobs=[-0.5] * len(tokens), versions=[0] * len(tokens),
                        finished=finish is not None, finish_reason=finish)


def coordinator(retries: int, *generators: str) -> RolloutCoordinator:
    c = RolloutCoordinator(4, max_group_retries=retries)
    for actor in generators:
        c.add_generator(actor)
        c.on_heartbeat(actor, free_groups=4, policy_version=0, free_seqs=8)
    return c


def refuse(c: RolloutCoordinator, actor: str, bad: RolloutChunk) -> bool:
    """What the hub does with a chunk the coordinator refuses: take the group back from its generator."""
    with pytest.raises(ChunkError) as e:
        c.on_chunk(actor, bad)
    return c.take_back(actor, bad.group_id, str(e.value), ended=[bad.sample_index] if bad.finished else [])


def test_a_refused_chunk_sends_the_group_elsewhere_from_the_tokens_held() -> None:
    c = coordinator(2, "a", "b")
    g = c.add_group([5, 6], 2, SAMPLING)
    c.on_heartbeat("b", free_groups=0, policy_version=0, free_seqs=0)  # room on a only
    assert [actor for actor, _ in c.dispatch()] == ["a"]
    c.on_chunk("a", chunk(g, 0, 0, [10, 11]))
    c.on_chunk("a", chunk(g, 1, 0, [20], finish="stop"))
    assert refuse(c, "a", chunk(g, 0, 5, [12]))  # a gap
    assert c.groups[g].generator is None and c.groups[g].retries.failures == 1
    assert c.groups[g].retries.reason == "refused" and "gap" in c.groups[g].retries.detail
    assert c.groups[g].draining == {"a": {0}}  # a may still be running sample 0
    c.on_heartbeat("a", free_groups=4, policy_version=0, free_seqs=8)
    assert c.dispatch() == []  # not back to a, which has room, while b has none
    c.on_heartbeat("b", free_groups=4, policy_version=0, free_seqs=8)
    [(actor, msg)] = c.dispatch()
    assert actor == "b" and [(r.index, r.token_ids) for r in msg.resume] == [(0, [10, 11])]
    assert c.on_chunk("a", chunk(g, 0, 2, [99])) is None  # a's late chunk: ignored
    done = c.on_chunk("b", chunk(g, 0, 2, [12], finish="length"))
    assert done is not None and done.samples[0].token_ids == [10, 11, 12] and done.dispatches == 2
    assert c.pop_finished() == [done] and c.pop_dropped() == [] and not c.groups_dropped


def test_a_retried_group_goes_to_another_generator_while_one_has_room() -> None:
    c = coordinator(2, "a", "b")
    g = c.add_group([5], 1, SAMPLING)
    [(first, _)] = c.dispatch()
    other = "b" if first == "a" else "a"
    assert refuse(c, first, chunk(g, 0, 3, [1], finish="stop"))  # its last chunk: nothing runs there now
    c.on_heartbeat(first, free_groups=8, policy_version=0, free_seqs=16)  # the most room, yet not chosen
    c.on_heartbeat(other, free_groups=1, policy_version=0, free_seqs=1)
    [(actor, _)] = c.dispatch()
    assert actor == other and c.groups[g].failed_on == {first}


def test_a_group_refused_past_max_group_retries_is_dropped_whole_and_never_emitted() -> None:
    dropped: list[Group] = []
    c = coordinator(1, "a")
    c.on_drop = dropped.append
    g = c.add_group([5, 6], 2, SAMPLING, payload="answer")
    c.dispatch()
    c.on_chunk("a", chunk(g, 1, 0, [20], finish="stop"))  # one sample finished: the group is partial
    assert refuse(c, "a", chunk(g, 0, 4, [10, 11], finish="stop")) is True  # its last chunk, refused: a ended it
    assert c.groups[g].draining == {}
    [(actor, msg)] = c.dispatch()  # the only generator, and it runs nothing of the group: back to a
    assert actor == "a" and [r.index for r in msg.resume] == [0]
    assert refuse(c, "a", chunk(g, 0, 1, [12]))  # the second failure: past max_group_retries = 1
    assert g not in c.groups and c.dispatch() == []
    assert c.on_chunk("a", chunk(g, 0, 0, [10], finish="stop")) is None  # nothing finishes it now
    assert c.pop_finished() == [] and c.num_finished() == 0
    [record] = c.pop_dropped()
    assert (record.group_id, record.reason, record.failures, record.payload) == (g, "refused", 2, "answer")
    assert record.prompt_token_ids == [5, 6] and "gap" in record.detail
    assert "dropped after 2 failures" in record.describe() and c.pop_dropped() == []
    assert c.groups_dropped == {"refused": 1} and [d.group_id for d in dropped] == [g]
    assert dropped[0].dropped == record
    assert c.generators["a"].groups == set()  # its place on a came back


def test_a_group_whose_generators_die_is_resumed_then_dropped_as_lost() -> None:
    c = coordinator(1, "a", "b")
    g = c.add_group([5], 1, SAMPLING)
    [(first, _)] = c.dispatch()
    c.on_chunk(first, chunk(g, 0, 0, [10]))
    assert c.remove_generator(first, "its connection closed") == [g]
    [(second, msg)] = c.dispatch()
    assert second != first and msg.resume[0].token_ids == [10] and c.groups[g].retries.failures == 1
    assert c.remove_generator(second) == []
    assert g not in c.groups and c.num_dropped() == 1
    [record] = c.pop_dropped()
    assert record.reason == "lost" and record.detail == f"generator {second} is gone (it is gone)"
    assert c.groups_dropped == {"lost": 1} and c.pop_finished() == []


def test_a_generator_is_not_sent_a_group_it_still_runs_until_its_last_chunks_came() -> None:
    """After ``Abort`` the generator ends what it still runs with ``abort`` chunks: those must not be
    merged into the group's next run on that same generator, so it waits for them."""
    c = coordinator(3, "a")
    g = c.add_group([5], 2, SAMPLING)
    c.dispatch()
    assert refuse(c, "a", chunk(g, 0, 3, [1]))
    assert c.groups[g].draining == {"a": {0, 1}} and c.dispatch() == []
    c.on_chunk("a", chunk(g, 0, 0, [], finish="abort"))  # its abort chunks arrive
    assert c.dispatch() == []
    c.on_chunk("a", chunk(g, 1, 0, [7], finish="abort"))
    [(actor, msg)] = c.dispatch()
    assert actor == "a" and msg.group_id == g and c.groups[g].samples[1].token_ids == []  # nothing of them kept


def test_a_group_refused_by_its_generator_fails_and_no_group_is_retried_without_a_limit() -> None:
    c = coordinator(0, "a", "b")
    g = c.add_group([5], 2, SAMPLING, lane="serve")
    [(actor, _)] = c.dispatch()
    assert c.take_back("b" if actor == "a" else "a", g, "not its group") is False  # only its generator's counts
    assert c.take_back(actor, g, "n=2 is over max_num_seqs", ended=range(2)) is True
    assert g not in c.groups and c.groups_dropped == {"refused": 1}
    assert c.pop_dropped(lane="serve") == []  # a served request's group: its submitter holds it
    with pytest.raises(ValueError, match=r"max_group_retries=101, expected an integer in \[0, 100\]"):
        RolloutCoordinator(4, max_group_retries=101)
    assert GroupRetries(2).fail("lost", "x") is True


def test_groups_past_the_queue_capacity_are_refused_and_resumed_ones_always_come_back() -> None:
    c = RolloutCoordinator(4, max_queued_groups=2)
    first = c.add_group([5], 1, SAMPLING)
    second = c.add_group([6], 1, SAMPLING, lane="eval")
    with pytest.raises(QueueFull, match=r"max_queued_groups = 2") as e:
        c.add_group([7], 1, SAMPLING, lane="serve")
    assert e.value.capacity == 2 and len(c.groups) == 2  # nothing queued
    c.add_generator("a")
    c.on_heartbeat("a", free_groups=4, policy_version=0, free_seqs=8)
    assert len(c.dispatch()) == 2
    third, fourth = c.add_group([7], 1, SAMPLING), c.add_group([8], 1, SAMPLING)
    assert c.remove_generator("a") == [first, second] and {third, fourth} <= set(c.groups)
    assert c.num_queued() + c.num_queued("eval") == 4  # over the capacity: accepted work is never refused
    with pytest.raises(QueueFull):
        c.add_group([9], 1, SAMPLING)
    with pytest.raises(ValueError, match=r"max_queued_groups=0, expected an integer in \[1, 1048576\]"):
        RolloutCoordinator(4, max_queued_groups=0)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_group_retries": 2.5}, "max_group_retries=2.5, expected an integer in [0, 100]"),
    ({"max_group_retries": True}, "max_group_retries=True, expected an integer"),
    ({"max_queued_groups": "3"}, "max_queued_groups='3', expected an integer in [1, "),
    ({"max_groups_in_flight": 1.5}, "max_groups_in_flight=1.5, expected a positive integer"),
])
def test_the_coordinators_counts_must_be_integers(kwargs: dict[str, object], words: str) -> None:
    """An embedding stack passing a float or a string gets a ValueError naming it, not a TypeError later."""
    args = {"max_groups_in_flight": 4, **kwargs}
    with pytest.raises(ValueError, match=re.escape(words)):
        RolloutCoordinator(**args)  # type: ignore[arg-type]
