"""The rollout client (the embedding API) against real generator processes: groups stream back,
weights flow out, and a generator killed mid-rollout loses and duplicates nothing."""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack
from pathlib import Path

import anyio
import pytest
from conftest import generator_process

from specroll.actors.client import RolloutClient, SyncRolloutClient
from specroll.engine.checkpoint import load_checkpoint
from specroll.protocol.messages import RolloutChunk
from specroll.protocol.sampling import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_killed_generators_groups_finish_elsewhere_from_their_streamed_tokens(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    streamed: dict[tuple[str, int], list[int]] = {}  # (group, sample) -> tokens seen so far
    by_actor: dict[str, set[str]] = {}

    def on_chunk(actor: str, chunk: RolloutChunk) -> None:
        by_actor.setdefault(actor, set()).add(chunk.group_id)

    sampling = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)
    async with RolloutClient(max_groups_in_flight=8, heartbeat_timeout_s=1.5, on_chunk=on_chunk) as client:
        with ExitStack() as procs:
            gens = {name: procs.enter_context(generator_process(client.endpoint, model, tmp_path / f"{name}.log",
                                                                "--stream-every", "1", actor_id=name))
                    for name in ("gen-a", "gen-b")}
            await client.wait_for_generators(2, timeout=60)
            groups = [await client.submit([5 + i, 6, 7, 8], 2, sampling) for i in range(6)]
            assert client.coordinator.groups_of("gen-a") and client.coordinator.groups_of("gen-b")
            with anyio.fail_after(60):  # wait until gen-a is mid-rollout
                while not any(len(client.coordinator.groups[g].samples[0].token_ids) >= 5
                              for g in client.coordinator.groups_of("gen-a")):
                    await anyio.sleep(0.01)
            victims = list(client.coordinator.groups_of("gen-a"))
            for g in victims:
                for i, s in enumerate(client.coordinator.groups[g].samples):
                    streamed[g, i] = list(s.token_ids)
            os.killpg(gens["gen-a"].pid, signal.SIGKILL)
            finished = [await client.next_finished(timeout=90) for _ in groups]
    assert victims and client.dead_generators == ["gen-a"] and client.coordinator.resumed_groups == len(victims)
    assert sorted(g.group_id for g in finished) == sorted(groups)  # none lost, none twice
    for g in finished:
        for i, s in enumerate(g.samples):
            assert len(s.token_ids) == len(s.logprobs) == len(s.versions) == 60
            if (g.group_id, i) in streamed:  # resumed: begins with exactly what was streamed before
                assert s.token_ids[: len(streamed[g.group_id, i])] == streamed[g.group_id, i]
    assert {g for g in victims} <= by_actor["gen-b"]  # the victims really finished on gen-b


def test_sync_client_round_trip_with_a_weight_update(tiny_checkpoint, tmp_path: Path):
    model = tiny_checkpoint("llama")
    weights = load_checkpoint(model).weights
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with SyncRolloutClient(heartbeat_timeout_s=5) as client, \
            generator_process(client.endpoint, model, tmp_path / "gen.log"):
        client.wait_for_generators(1, timeout=60)
        client.submit([5, 6, 7], 2, greedy, payload="x")
        first = client.next_finished(timeout=60)
        assert first.payload == "x" and all(s.versions == [0] * 8 for s in first.samples)
        client.publish_weights(weights, version=3, dtype="float32")
        client.wait_for_version(3, timeout=60)
        with pytest.raises(ValueError, match="not above"):
            client.publish_weights(weights, version=3)
        client.submit([5, 6, 7], 1, greedy)
        second = client.next_finished(timeout=60)
    assert second.samples[0].versions == [3] * 8
    assert second.samples[0].token_ids == first.samples[0].token_ids  # same weights, same greedy tokens
