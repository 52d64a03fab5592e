"""The trainer's side of the retry rule: a dropped group gives its place back, its prompt is skipped
or served again (``trainer.dropped_prompts``), it is counted by reason in the next metrics line, and
too many in a row end the run; the feeder handles groups the hub drops (over a real socket, a fake
generator whose chunk is refused); an episode group's failures count together."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest
from helpers.fake_peers import fake_generators
from helpers.timeouts import guard

from specroll.actors.config import load_config
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.trainer.episodes import EpisodeFailed, episode_seed, run_group
from specroll.actors.trainer.feeder import Feeder
from specroll.actors.trainer.generator_watch import GeneratorWatch
from specroll.actors.trainer.group_drops import GroupDrops
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.actors.trainer.setup import TrainerError
from specroll.protocol.messages import Abort, Error, RolloutChunk, SubmitGroup
from specroll.rl.admission import Admission
from specroll.rl.episodes import Episode, Turn
from specroll.rl.group_retries import GroupRetries
from specroll.rl.tasks import builtin_prompts

pytestmark = pytest.mark.anyio
PROMPTS = builtin_prompts(4)
IDS = [[10 + i, 20 + i] for i in range(4)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("mode", ["skip", "retry"])
def test_a_dropped_group_gives_its_place_back_and_its_prompt_is_skipped_or_served_again(
        mode: str, caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(None, ["trainer.batch_groups=1", f"trainer.dropped_prompts='{mode}'"])
    prompts = PromptCycle(IDS, PROMPTS, seed=0)
    admission = Admission(1, 1, 8)
    untrained: dict[str, int] = {}
    drops = GroupDrops(config, prompts, admission, untrained)
    for group_id in ("g0", "g1"):
        untrained[group_id] = prompts.next().position
        admission.on_submit()
    drops.drop("g1", "p1", "refused", "a gap", by_hub=True)
    assert "group g1 (prompt p1) dropped, none of it trained (refused: a gap)" in caplog.text
    assert untrained == {"g0": 0} and admission.submitted == 1  # out of the window and the checkpoint
    assert prompts.next().position == (1 if mode == "retry" else 2)
    assert drops.metrics() == {"groups_dropped": {"refused": 1}, "groups_dropped_total": 1}
    drops.drop("g9", "p9", "failed", "timeout", by_hub=False)
    drops.drop("g8", "p8", "lost", "gone", by_hub=True)
    assert drops.metrics() == {"groups_dropped": {"failed": 1, "lost": 1}, "groups_dropped_total": 3}
    assert drops.metrics()["groups_dropped"] == {} and drops.not_in_hub == {"failed": 1}
    drops.finished()
    for i in range(4):  # 4·B in a row are borne; one more ends the run, refused (not restarted)
        drops.drop(f"r{i}", "p", "refused", "bad ids", by_hub=True)
    with pytest.raises(TrainerError, match="5 groups in a row were dropped and none finished") as e:
        drops.drop("r4", "p", "refused", "bad ids", by_hub=True)
    assert e.value.exit_code == 2 and "refused: bad ids" in str(e.value)


async def test_the_feeder_takes_a_group_the_hub_dropped_out_and_submits_its_prompt_again() -> None:
    config = load_config(None, ["trainer.mode='sync'", "trainer.batch_groups=1", "trainer.group_size=2",
                                "trainer.max_group_retries=0", "trainer.dropped_prompts='retry'"])
    async with RolloutClient(heartbeat_timeout_s=60, vocab_size=100, max_group_retries=0) as client, \
            fake_generators(client.endpoint, "gen") as (gen,):
        await gen.register(free_groups=4, free_seqs=8)
        await client.wait_for_generators(1, timeout=guard(30))
        feeder = Feeder(config, client, PromptCycle(IDS, PROMPTS, seed=0), GeneratorWatch(client, 60))
        await feeder.submit_batch()
        first = await gen.expect(SubmitGroup)
        await gen.stream(first.group_id, 0, 0, token=500, count=1)  # outside the vocabulary: dropped at once
        await gen.expect(Error)
        await gen.expect(Abort)
        for i in range(2):
            await gen.channel.send(RolloutChunk(group_id=first.group_id, sample_index=i, offset=0, token_ids=[],
                                                logprobs=[], versions=[], finished=True, finish_reason="abort"))
        batch: list = []

        async def take() -> None:
            batch.extend(await feeder.wait_for_batch())

        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            again = await gen.expect(SubmitGroup)  # sync mode: the step still needs its batch
            assert again.prompt_token_ids == first.prompt_token_ids and again.group_id != first.group_id
            for i in range(2):
                await gen.stream(again.group_id, i, 0, token=3, count=2, reason="stop")
        [group] = batch
    assert group.group_id == again.group_id and feeder.untrained == {again.group_id: 0}
    assert feeder.drops.total == Counter(refused=1) and feeder.admission.submitted == 1
    assert client.coordinator.groups_dropped == {"refused": 1}


async def test_an_episode_groups_failures_count_together_against_max_group_retries() -> None:
    """One rule for every group: two episodes failing once each are two failures of their group."""
    failing = {episode_seed(0, 0, 0), episode_seed(0, 1, 0)}  # the first try of each episode
    seen: list[str] = []

    async def episode(seed: int) -> Episode:
        if seed in failing:
            raise EpisodeFailed("timeout: over task.episode_timeout_s")
        return Episode([Turn([1], [2], [-1.0], [0])], float(seed))  # its reward says which try it was

    assert await run_group(episode, "g", 2, 0, GroupRetries(1), lambda e: seen.append(str(e))) is None
    retries = GroupRetries(2)
    ran = await run_group(episode, "g", 2, 0, retries, lambda e: seen.append(str(e)))
    assert ran is not None and retries.failures == 2
    assert [e.reward for e in ran] == [episode_seed(0, 0, 1), episode_seed(0, 1, 1)]  # the second tries, in order
    assert len(seen) == 4
