"""The generators' prefix caches through the rollout client: counters from each generator's ``Stats``
(``prefix_cache_stats``) and resets (``reset_prefix_cache``: ``ResetPrefixCache`` → ``AckResetPrefixCache``).
Fake generators over real sockets, then a real generator process."""

from __future__ import annotations

import anyio
import pytest
from helpers.fake_peers import fake_generators
from helpers.processes import generator_process, wait_until
from helpers.timeouts import guard

from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.prefix_cache import PrefixCacheStats
from specroll.engine.config import EngineConfig
from specroll.protocol.messages import AckResetPrefixCache, Dead, ResetPrefixCache, Stats
from specroll.protocol.sampling import SamplingParams

pytestmark = pytest.mark.anyio

HANG_S = guard(60)
"""Only a hang guard, never what a test checks."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def stats(prompt_tokens: int, cached_prompt_tokens: int, num_tokens: int = 0) -> Stats:
    return Stats(policy_version=0, num_steps=1, num_tokens=num_tokens, busy_s=0.0, idle_s=0.0,
                 prompt_tokens=prompt_tokens, cached_prompt_tokens=cached_prompt_tokens)


def test_hit_rate() -> None:
    assert PrefixCacheStats(prompt_tokens=200, cached_prompt_tokens=150).hit_rate == 0.75
    assert PrefixCacheStats(prompt_tokens=0, cached_prompt_tokens=0).hit_rate == 0.0


async def test_counters_of_the_connected_generators_from_their_last_stats() -> None:
    async with RolloutClient(heartbeat_timeout_s=60) as client, \
            fake_generators(client.endpoint, "gen-a", "gen-b") as (a, b):
        await a.register()
        await b.register()
        await client.wait_for_generators(2, timeout=HANG_S)
        assert client.prefix_cache_stats() == {}  # no Stats yet
        await a.channel.send(stats(40, 0))
        await a.channel.send(stats(100, 48))
        await b.channel.send(stats(30, 0))
        await wait_until(lambda: len(client.generator_stats) == 2 and client.generator_stats["gen-a"].prompt_tokens
                         == 100, HANG_S, "both generators' Stats")
        assert client.prefix_cache_stats() == {"gen-a": PrefixCacheStats(100, 48), "gen-b": PrefixCacheStats(30, 0)}
        assert client.prefix_cache_stats()["gen-a"].hit_rate == 0.48
        await b.channel.send(Dead(actor_id="gen-b", reason="exiting"))
        await wait_until(lambda: "gen-b" not in client.coordinator.generators, HANG_S, "gen-b to be gone")
        assert client.prefix_cache_stats() == {"gen-a": PrefixCacheStats(100, 48)}  # a gone generator's are not listed


async def test_a_reset_counts_the_acknowledgements_and_waits_for_no_generator_that_is_gone() -> None:
    async with RolloutClient(heartbeat_timeout_s=60) as client, \
            fake_generators(client.endpoint, "gen-a", "gen-b") as (a, b):
        await a.register()
        await b.register()
        await client.wait_for_generators(2, timeout=HANG_S)
        result: list[int] = []

        async def reset() -> None:
            result.append(await client.reset_prefix_cache(timeout=10 * HANG_S))  # ends by acks or deaths only

        async with anyio.create_task_group() as tg:
            tg.start_soon(reset)
            to_a, to_b = await a.expect(ResetPrefixCache), await b.expect(ResetPrefixCache)
            assert to_a.request_id == to_b.request_id
            await a.channel.send(AckResetPrefixCache(request_id=to_a.request_id))
            await a.channel.send(AckResetPrefixCache(request_id=to_a.request_id))  # twice: counted once
            await b.channel.send(Dead(actor_id="gen-b", reason="exiting"))  # dies instead of answering
            await wait_until(lambda: result, HANG_S, "the reset to end once gen-b is gone")
        assert result == [1]
        assert client.protocol_errors == 0


async def test_a_silent_generator_is_not_counted_and_its_late_answer_is_dropped() -> None:
    async with RolloutClient(heartbeat_timeout_s=60) as client, fake_generators(client.endpoint, "gen-a") as (a,):
        await a.register()
        await client.wait_for_generators(1, timeout=HANG_S)
        with anyio.fail_after(HANG_S):  # a hang guard: the reset gives up after its timeout
            assert await client.reset_prefix_cache(timeout=0.2) == 0
        late = await a.expect(ResetPrefixCache)
        await a.channel.send(AckResetPrefixCache(request_id=late.request_id))
        await a.channel.send(stats(1, 0))  # read after the late answer: once it is here, the answer was handled
        await wait_until(lambda: "gen-a" in client.generator_stats, HANG_S, "gen-a's Stats")
        assert client.protocol_errors == 0 and "gen-a" in client.coordinator.generators


async def test_a_reset_with_no_generator_connected_is_zero() -> None:
    async with RolloutClient() as client:
        with anyio.fail_after(HANG_S):  # nothing to wait for: it returns at once
            assert await client.reset_prefix_cache(timeout=10 * HANG_S) == 0


@pytest.mark.integration
async def test_a_real_generator_counts_a_repeated_prompt_as_cached_until_its_cache_is_reset(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    page = EngineConfig().page_size  # the generator's default
    prompt = [(7 * i + 5) % 300 for i in range(2 * page + 5)]  # 2 full pages and a partial one
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with RolloutClient(heartbeat_timeout_s=60) as client:
        with generator_process(client.endpoint, model, tmp_path / "gen.log") as proc:
            await client.wait_for_generators(1, timeout=HANG_S)

            async def generate(k: int) -> PrefixCacheStats:
                """Run the prompt once more (the k-th time); the counters once a Stats covers it."""
                await client.submit(prompt, 1, greedy)
                await client.next_finished(timeout=HANG_S)
                # Stats are cumulative and sent every --stats-s: one with k groups' tokens was made after the k-th
                # request was admitted, so it holds its prompt too.
                await wait_until(lambda: client.generator_stats.get("gen-0") is not None
                                 and client.generator_stats["gen-0"].num_tokens >= k * greedy.max_tokens,
                                 HANG_S, f"a Stats covering request {k}")
                return client.prefix_cache_stats()["gen-0"]

            assert await generate(1) == PrefixCacheStats(len(prompt), 0)
            assert await generate(2) == PrefixCacheStats(2 * len(prompt), 2 * page)  # its 2 full pages were cached
            assert await client.reset_prefix_cache(timeout=HANG_S) == 1
            assert await generate(3) == PrefixCacheStats(3 * len(prompt), 2 * page)  # no new hit after the reset
            assert await generate(4) == PrefixCacheStats(4 * len(prompt), 4 * page)  # cached again from request 3
            assert proc.poll() is None
        assert client.protocol_errors == 0
