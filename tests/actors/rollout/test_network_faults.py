"""Network faults between a generator and the hub, made by a TCP relay (``benchmarks/fault_proxy.py``)
between a real generator process and a RolloutClient: a stalled link, a connection reset, a
half-open connection. Each time the group the generator was decoding finishes exactly once, every
sample continuing exactly the tokens the hub held, and the hub lives on.

Every wait is for an event (a generator declared gone, a reconnection seen by the relay, a chunk),
never for a time: the hang guards only end a test that would otherwise wait forever."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from helpers.processes import generator_process, wait_until
from helpers.timeouts import guard

from specroll.actors.rollout.client import RolloutClient
from specroll.protocol.messages import RolloutChunk
from specroll.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

TIMEOUT_S = 2.0
"""The hub's heartbeat timeout (``network.heartbeat_timeout_s``); the generators heartbeat every 0.2 s."""
ZMTP_S = 10.0
"""The generators' ZMTP heartbeat timeout (``protocol.sockets.DEFAULT_HEARTBEAT_TIMEOUT_MS``): a
generator whose PINGs go unanswered this long drops its connection and makes a new one."""
HANG_S = guard(90.0)
LONG_CONTEXT = 4096
"""Positions of the model: a rollout thousands of tokens long is still running when the fault hits."""
SAMPLING = SamplingParams(temperature=1.0, max_tokens=LONG_CONTEXT - 16, ignore_eos=True, seed=1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Chunks:
    """Every chunk the hub merged, in order, with its sender."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, RolloutChunk]] = []

    def __call__(self, actor: str, chunk: RolloutChunk) -> None:
        self.seen.append((actor, chunk))

    def count(self, actor: str) -> int:
        return sum(a == actor for a, _ in self.seen)

    def merged(self, group: str, sample: int) -> list[int]:
        """The token ids of ``sample``'s chunks, concatenated in the order they were merged."""
        return [t for _, c in self.seen if c.group_id == group and c.sample_index == sample for t in c.token_ids]

    def taken_over(self, actor: str, group: str) -> dict[int, tuple[int, int]]:
        """For each sample ``actor`` continued: (its first chunk's offset, the tokens merged before it)."""
        before: dict[int, int] = {}
        first: dict[int, tuple[int, int]] = {}
        for a, c in self.seen:
            if c.group_id != group:
                continue
            if a == actor and c.sample_index not in first:
                first[c.sample_index] = (c.offset, before.get(c.sample_index, 0))
            before[c.sample_index] = before.get(c.sample_index, 0) + len(c.token_ids)
        return first


async def finish(client: RolloutClient, chunks: Chunks, group: str) -> None:
    """The group finishes, once, every sample ``max_tokens`` long and made of exactly the chunks the hub
    merged (none lost, none twice); nothing else is left."""
    done = await client.next_finished(timeout=guard(HANG_S))
    assert done.group_id == group
    for i, sample in enumerate(done.samples):
        assert len(sample.token_ids) == len(sample.logprobs) == len(sample.versions) == SAMPLING.max_tokens
        assert list(sample.token_ids) == chunks.merged(group, i)
    assert client.num_finished == 0 and client.num_pending == 0


async def start_group(client: RolloutClient, chunks: Chunks, actor: str, generators: int = 1) -> str:
    """Submit the group once ``generators`` are connected, on ``actor`` (pinned: the pin lapses once
    ``actor`` is gone); return its id after ``actor``'s first chunk."""
    await client.wait_for_generators(generators, timeout=guard(HANG_S))
    group = await client.submit([5, 6, 7, 8], 2, SAMPLING, pin=actor)
    await wait_until(lambda: chunks.count(actor) > 0, guard(HANG_S), f"{actor}'s first chunk")
    return group


def declared_gone(client: RolloutClient, actor: str) -> Callable[[], bool]:
    return lambda: actor in client.dead_generators


@pytest.mark.parametrize("new_connections", [True, False], ids=["link", "flow"])
async def test_a_stall_past_the_heartbeat_timeouts_resumes_the_group_once(tiny_checkpoint, tmp_path: Path,
                                                                           new_connections: bool) -> None:
    """The relay stalls past the hub's heartbeat timeout and the generator's ZMTP timeout, then moves
    again. ``link``: the generator's new connection stalls too; ``flow``: only the open one does, so
    the new connection takes the generator's route over while the old one still holds what the
    generator sent during the stall — which it delivers, and is then closed, once the relay moves:
    the path on which libzmq used to abort the trainer (``benchmarks/zmq_abort.py``)."""
    model = tiny_checkpoint("llama", max_position_embeddings=LONG_CONTEXT)
    chunks = Chunks()
    async with RolloutClient(heartbeat_timeout_s=TIMEOUT_S, on_chunk=chunks) as client:
        with FaultProxy(client.endpoint) as proxy, \
                generator_process(proxy.endpoint, model, tmp_path / "gen-a.log", actor_id="gen-a"):
            group = await start_group(client, chunks, "gen-a")
            proxy.stall(None, new_connections=new_connections)
            await wait_until(declared_gone(client, "gen-a"), guard(HANG_S), "the hub to declare the stalled gen-a gone")
            await wait_until(lambda: proxy.accepted >= 2, guard(ZMTP_S + HANG_S),
                             "gen-a to give up on its stalled connection and make a new one")
            if not new_connections:  # the new connection took gen-a's route over: gen-a registered on it
                await wait_until(lambda: "gen-a" in client.coordinator.generators, guard(HANG_S),
                                 "gen-a to register again on its new connection")
            proxy.resume()
            await finish(client, chunks, group)
            assert "gen-a" in client.coordinator.generators  # back, registered again
        assert client.dead_generators == ["gen-a"] and client.coordinator.resumed_groups == 1
        assert chunks.count("gen-a") > 2  # chunks before the stall, and from the resume


async def test_a_reset_connection_is_made_again_and_the_group_finishes_once(tiny_checkpoint, tmp_path: Path) -> None:
    """The relay resets the generator's connection (RST both ways) while it streams: the generator
    connects again and the group finishes once — continued where the hub's tokens end, whether the
    generator went on (nothing was lost) or was declared gone and resumed it (chunks were lost)."""
    model = tiny_checkpoint("llama", max_position_embeddings=LONG_CONTEXT)
    chunks = Chunks()
    async with RolloutClient(heartbeat_timeout_s=TIMEOUT_S, on_chunk=chunks) as client:
        with FaultProxy(client.endpoint) as proxy, \
                generator_process(proxy.endpoint, model, tmp_path / "gen-a.log", actor_id="gen-a"):
            group = await start_group(client, chunks, "gen-a")
            assert proxy.cut("reset") == 1
            await wait_until(lambda: proxy.accepted >= 2, guard(HANG_S), "gen-a to connect again")
            await finish(client, chunks, group)
            assert "gen-a" in client.coordinator.generators


async def test_a_half_open_connection_is_found_by_heartbeats_and_its_group_resumes_elsewhere(
        tiny_checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The relay stops gen-a's connection without closing it (no FIN, no RST: both sockets stay
    ESTABLISHED) and refuses its new ones, as for a host lost behind a NAT: only the heartbeats can
    tell. The hub declares gen-a gone for its silence and the group resumes on gen-b from exactly
    the tokens the hub held."""
    model = tiny_checkpoint("llama", max_position_embeddings=LONG_CONTEXT)
    chunks = Chunks()
    caplog.set_level(logging.WARNING, logger="specroll.client")
    async with RolloutClient(heartbeat_timeout_s=TIMEOUT_S, on_chunk=chunks) as client:
        # gen-b is connected before gen-a starts the group: the cut comes at gen-a's first chunk, not
        # after gen-b's start-up, which a fast CPU could let gen-a's whole rollout outlast
        with FaultProxy(client.endpoint) as proxy, \
                generator_process(proxy.endpoint, model, tmp_path / "gen-a.log", actor_id="gen-a"), \
                generator_process(client.endpoint, model, tmp_path / "gen-b.log", actor_id="gen-b"):
            group = await start_group(client, chunks, "gen-a", generators=2)
            proxy.refuse_new()
            assert proxy.cut("half-open") == 1
            await wait_until(declared_gone(client, "gen-a"), guard(HANG_S), "the hub to declare gen-a gone")
            await finish(client, chunks, group)
    taken = chunks.taken_over("gen-b", group)
    assert len(taken) == 2 and all(0 < offset == before for offset, before in taken.values())
    assert any("generator gen-a is gone (silent for" in r.getMessage() for r in caplog.records)
