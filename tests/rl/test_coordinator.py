"""The rollout coordinator's bookkeeping: dispatch by capacity, chunk assembly, resume after a death."""

from __future__ import annotations

import random

import pytest

from specroll.protocol.messages import RolloutChunk, SampleResume, SubmitGroup
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import ChunkError, RolloutCoordinator

SAMPLING = SamplingParams(temperature=1.0, max_tokens=32)


def chunk(group: str, index: int, offset: int, tokens: list[int], version: int = 0, finish: str | None = None):
    return RolloutChunk(group_id=group, sample_index=index, offset=offset, token_ids=tokens,
                        logprobs=[-0.5] * len(tokens), versions=[version] * len(tokens),
                        finished=finish is not None, finish_reason=finish)


def test_dispatch_follows_free_capacity_and_the_in_flight_bound() -> None:
    c = RolloutCoordinator(max_groups_in_flight=3)
    for p in range(5):
        c.add_group([1, 2, p + 3], 2, SAMPLING)
    assert c.dispatch() == []  # no generator yet
    c.add_generator("a")
    c.add_generator("b")
    c.on_heartbeat("a", free_groups=2, policy_version=0)
    c.on_heartbeat("b", free_groups=1, policy_version=0)
    sent = c.dispatch()
    assert sorted(actor for actor, _ in sent) == ["a", "a", "b"]
    assert [m.group_id for _, m in sent] == ["g0", "g1", "g2"]  # oldest first
    assert c.num_in_flight() == 3 and c.num_queued() == 2
    c.on_heartbeat("b", free_groups=5, policy_version=0)
    assert c.dispatch() == []  # the in-flight bound holds even with free capacity


def test_chunks_assemble_and_overlaps_are_deduplicated() -> None:
    c = RolloutCoordinator(4)
    c.add_generator("a")
    c.on_heartbeat("a", 4, 0)
    g = c.add_group([5, 6], 2, SAMPLING, payload="answer")
    c.dispatch()
    assert c.on_chunk("a", chunk(g, 0, 0, [10, 11], version=1)) is None
    assert c.on_chunk("a", chunk(g, 0, 1, [11, 12], version=2)) is None  # overlap agrees: keep 12 only
    assert c.on_chunk("a", chunk(g, 1, 0, [20], finish="stop")) is None
    done = c.on_chunk("a", chunk(g, 0, 3, [], finish="length"))
    assert done is not None and done.payload == "answer"
    assert done.samples[0].token_ids == [10, 11, 12] and done.samples[0].versions == [1, 1, 2]
    assert [s.finish_reason for s in done.samples] == ["length", "stop"]
    assert c.pop_finished() == [done] and g not in c.groups
    assert c.generators["a"].free_groups == 4  # its slot came back
    assert c.on_chunk("a", chunk(g, 0, 3, [99])) is None and c.ignored_chunks == 1  # late chunk: ignored


@pytest.mark.parametrize(
    "bad, message",
    [
        (chunk("g0", 0, 5, [1]), "gap"),
        (chunk("g0", 0, 0, [10, 99]), "disagrees"),
        (chunk("g0", 7, 0, [1]), "samples"),
        (chunk("g9", 0, 0, [1]), "unknown group"),
    ],
)
def test_bad_chunks_are_refused_and_change_nothing(bad: RolloutChunk, message: str) -> None:
    c = RolloutCoordinator(4)
    c.add_generator("a")
    c.on_heartbeat("a", 4, 0)
    c.add_group([5], 2, SAMPLING)
    c.dispatch()
    c.on_chunk("a", chunk("g0", 0, 0, [10, 11]))
    with pytest.raises(ChunkError, match=message):
        c.on_chunk("a", bad)
    assert c.groups["g0"].samples[0].token_ids == [10, 11]


def test_tokens_after_a_finish_are_refused() -> None:
    c = RolloutCoordinator(4)
    c.add_generator("a")
    c.on_heartbeat("a", 4, 0)
    c.add_group([5], 2, SAMPLING)
    c.dispatch()
    c.on_chunk("a", chunk("g0", 0, 0, [10], finish="stop"))
    with pytest.raises(ChunkError, match="already finished"):
        c.on_chunk("a", chunk("g0", 0, 1, [11]))


def test_a_dead_generators_groups_resume_elsewhere_without_loss_or_duplication() -> None:
    """Simulate many generators dying at random points; every group ends with exactly the tokens
    its samples would have had (each sample's stream is a fixed sequence), none lost or doubled."""
    rng = random.Random(0)
    c = RolloutCoordinator(max_groups_in_flight=8)
    truth: dict[tuple[str, int], list[int]] = {}
    for p in range(20):
        g = c.add_group([p + 1], 3, SAMPLING)
        for i in range(3):
            truth[g, i] = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
    alive = {f"gen{i}" for i in range(3)}
    next_gen = 3
    for a in alive:
        c.add_generator(a)
    streamed: dict[tuple[str, int], int] = {}  # what each (group, sample) has streamed, per its generator
    finished = []
    for _ in range(2000):  # bounded: a coordinator that loses a group must fail, not hang
        if len(finished) == 20:
            break
        for a in alive:
            c.on_heartbeat(a, 2 - len(list(c.groups_of(a))), 0)
        for _actor, msg in c.dispatch():
            for r in msg.resume:  # the new generator starts each resumed sample after its tokens
                assert r.token_ids == truth[msg.group_id, r.index][: len(r.token_ids)]
                streamed[msg.group_id, r.index] = len(r.token_ids)
            if not msg.resume:
                for i in range(msg.n):
                    streamed[msg.group_id, i] = 0
        # every live generator streams a few tokens of each of its samples
        for a in sorted(alive):
            for g in list(c.groups_of(a)):
                for i, sample in enumerate(c.groups[g].samples):
                    if sample.finished:
                        continue
                    at, full = streamed[g, i], truth[g, i]
                    step = rng.randrange(1, 6)
                    end = min(at + step, len(full))
                    done = c.on_chunk(a, chunk(g, i, at, full[at:end], finish="stop" if end == len(full) else None))
                    streamed[g, i] = end
                    if done is not None:
                        finished.append(done)
                        break
        if rng.random() < 0.3 and len(alive) > 1:  # a generator dies; a fresh one joins
            dead = rng.choice(sorted(alive))
            alive.remove(dead)
            c.remove_generator(dead)
            c.add_generator(f"gen{next_gen}")
            alive.add(f"gen{next_gen}")
            next_gen += 1
    assert c.resumed_groups > 0
    assert sorted(g.group_id for g in finished) == sorted({g for g, _ in truth})  # each group once
    for g in finished:
        for i, s in enumerate(g.samples):
            assert s.token_ids == truth[g.group_id, i]
            assert len(s.logprobs) == len(s.versions) == len(s.token_ids)


def test_a_resume_carries_every_held_token_of_each_unfinished_sample() -> None:
    """The ``SubmitGroup`` that resumes a dead generator's group: each unfinished sample with every token,
    logprob and version held (the last one too, across chunks and across an earlier resume), no finished
    sample, and the group's prompt, n and sampling unchanged."""
    sampling = SamplingParams(temperature=0.7, max_tokens=9, seed=3)
    c = RolloutCoordinator(4)
    for a in ("a", "b", "c"):
        c.add_generator(a)
    c.on_heartbeat("a", 1, 0)
    g = c.add_group([5, 6, 7], 4, sampling)
    [(_, fresh)] = c.dispatch()
    assert fresh.resume == ()
    c.on_chunk("a", RolloutChunk(group_id=g, sample_index=0, offset=0, token_ids=[10, 11], logprobs=[-0.1, -0.2],
                                 versions=[1, 1]))
    c.on_chunk("a", RolloutChunk(group_id=g, sample_index=0, offset=2, token_ids=[12], logprobs=[-0.3], versions=[2]))
    c.on_chunk("a", chunk(g, 1, 0, [20, 21], finish="stop"))
    c.on_chunk("a", RolloutChunk(group_id=g, sample_index=2, offset=0, token_ids=[30], logprobs=[-0.4], versions=[2]))
    assert c.remove_generator("a") == [g]  # sample 3 streamed nothing yet
    c.on_heartbeat("b", 1, 0)
    [(actor, resume)] = c.dispatch()
    assert actor == "b"
    assert resume == SubmitGroup(group_id=g, prompt_token_ids=[5, 6, 7], n=4, sampling=sampling, resume=(
        SampleResume(index=0, token_ids=[10, 11, 12], logprobs=[-0.1, -0.2, -0.3], versions=[1, 1, 2]),
        SampleResume(index=2, token_ids=[30], logprobs=[-0.4], versions=[2]),
        SampleResume(index=3, token_ids=[], logprobs=[], versions=[]),
    ))
    c.on_chunk("b", RolloutChunk(group_id=g, sample_index=0, offset=3, token_ids=[13], logprobs=[-0.5], versions=[3]))
    c.on_chunk("b", chunk(g, 2, 1, [], finish="length"))
    c.on_chunk("b", RolloutChunk(group_id=g, sample_index=3, offset=0, token_ids=[40], logprobs=[-0.6], versions=[3]))
    assert c.remove_generator("b") == [g]
    c.on_heartbeat("c", 1, 0)
    [(actor, again)] = c.dispatch()
    assert actor == "c"
    assert again == SubmitGroup(group_id=g, prompt_token_ids=[5, 6, 7], n=4, sampling=sampling, resume=(
        SampleResume(index=0, token_ids=[10, 11, 12, 13], logprobs=[-0.1, -0.2, -0.3, -0.5], versions=[1, 1, 2, 3]),
        SampleResume(index=3, token_ids=[40], logprobs=[-0.6], versions=[3]),
    ))
