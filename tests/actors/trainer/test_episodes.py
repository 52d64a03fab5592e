"""Episodes run through the real server in front of a real generator process, as the trainer runs
them (``actors/trainer/episodes.py``): a 2-turn and a 4-turn episode train exactly the tokens the
server returned (the environment's masked), their trainer logprobs equal the generator's behavior
logprobs (the packed sequence is what the generator saw); a parse failure is counted; a group
whose episode keeps failing is dropped whole."""

from __future__ import annotations

import pytest
import torch
from helpers.server import served

from specroll.actors.config import load_config
from specroll.actors.server.tool_calls import HermesToolParser, ParsedToolCalls
from specroll.actors.trainer.episode_metrics import episode_metrics
from specroll.actors.trainer.episodes import EpisodeFeeder, EpisodeRunner, episode_seed
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.actors.trainer.setup import TrainerError
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.envs.base import EpisodeOutcome
from specroll.rl.episodes import EpisodeGroup, pack_episode_groups, stitch
from specroll.rl.grpo_step import response_logprobs
from specroll.rl.tasks import Prompt, builtin_prompts

pytestmark = [pytest.mark.anyio, pytest.mark.integration]
PROMPT = Prompt("p0", "What is 2 * 3?", "6")
TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _turns_env(k: int, returned: list, tools: bool = False):
    """An environment of ``k`` model turns, each answered by a tool message; it keeps what the
    server returned for each turn."""

    async def env(client, prompt):
        messages = [{"role": "user", "content": prompt.question}]
        extra = {"tools": [TOOL]} if tools else {}
        for t in range(k):
            reply = await client.chat.completions.create(
                model=prompt.model, messages=messages, logprobs=True, **{**prompt.sampling, "max_tokens": 5},
                extra_body={"return_token_ids": True}, **extra)
            choice = reply.choices[0]
            returned.append((reply.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                             [c.logprob for c in choice.logprobs.content], choice.model_extra["token_versions"]))
            messages += [{"role": "assistant", "content": choice.message.content},
                         {"role": "user", "content": f"result {t}"}]
        return EpisodeOutcome(1.0 if len(returned) % 2 else 0.0, {"turns_seen": k})

    return env


@pytest.mark.parametrize("k", [2, 4])
async def test_episodes_train_exactly_the_tokens_the_server_returned(tiny_llama, tmp_path, k):
    async with served(tiny_llama, tmp_path, overrides=("task.max_turns=4",)) as s:
        returned: list = []
        runner = EpisodeRunner(s.config, s.state, s.url, _turns_env(k, returned))
        sampling = {"temperature": 1.0}
        episodes = [await runner.episode(PROMPT, seed, sampling) for seed in (1, 2)]
        await runner.aclose()
    group = EpisodeGroup("g", PROMPT, episodes)
    for e, mine in zip(episodes, (returned[:k], returned[k:]), strict=True):
        assert [(t.prompt_token_ids, t.token_ids, t.versions) for t in e.turns] == [(p, i, v) for p, i, _, v in mine]
        assert [x for t in e.turns for x in t.logprobs] == pytest.approx([x for _, _, lp, _ in mine for x in lp],
                                                                          abs=1e-4)
        [segment] = stitch(e.turns)  # every turn's prompt extended the one before (token-in-token-out)
        assert [t for t, keep in zip(segment.token_ids, segment.trained, strict=True) if keep] == \
            [t for _, ids, _, _ in mine for t in ids]
    _, batch = pack_episode_groups([group], normalize_std=True, fill_version=0)
    model_tokens = [t for e in episodes for turn in e.turns for t in turn.token_ids]
    assert batch.targets[batch.loss_mask].tolist() == model_tokens  # nothing of the environment is trained
    assert int((~batch.loss_mask & (batch.targets != 0)).sum()) > 0  # ... though it is in the sequences
    ckpt = load_checkpoint(tiny_llama, torch.float32)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    with torch.no_grad():
        logprobs = response_logprobs(model, batch, torch.arange(batch.input_ids.shape[0]))
    # the trainer's logprob of each model token is the generator's: the packed sequence is what it saw
    assert logprobs[batch.loss_mask] == pytest.approx(batch.behavior_logprobs[batch.loss_mask], abs=2e-3)


async def test_parse_failures_are_counted_and_a_failing_group_is_dropped_whole(tiny_llama, tmp_path, monkeypatch):
    def unparsed(self, text, names, new_id):  # as if every reply held one malformed <tool_call> block
        return ParsedToolCalls(text, [], 1)

    monkeypatch.setattr(HermesToolParser, "parse", unparsed)
    attempts: list[int] = []

    bad = {episode_seed(1, 1, attempt) for attempt in range(3)}

    async def flaky(client, prompt):
        if prompt.seed in bad:  # episode 1 of the group of seed 1 fails, every time
            attempts.append(prompt.seed)
            raise RuntimeError("sandbox crashed")
        return await _turns_env(2, [], tools=True)(client, prompt)

    overrides = ("task.max_turns=4", "trainer.max_group_retries=2", "trainer.group_size=2", "trainer.batch_groups=1")
    async with served(tiny_llama, tmp_path, overrides=overrides) as s:
        runner = EpisodeRunner(s.config, s.state, s.url, flaky)
        ok = await runner.group("g-ok", PROMPT, 2, seed=0, sampling={"temperature": 1.0})
        attempts.clear()
        dropped = await runner.group("g-bad", PROMPT, 2, seed=1, sampling={"temperature": 1.0})
        assert len(s.state.router.episodes) == 0  # every session closed, the cancelled ones too
        await runner.aclose()
    assert dropped is None and len(attempts) == 3  # one episode, tried 1 + max_group_retries times
    assert runner.failures["environment error"] == 3
    assert isinstance(ok, EpisodeGroup) and all(t.tool_call_errors == 1 for e in ok.episodes for t in e.turns)

    class _Feeder:  # what episode_metrics reads of a feeder
        pass
    feeder = _Feeder()
    feeder.runner = runner
    metrics = episode_metrics([ok], feeder)  # type: ignore[arg-type]
    assert metrics["tool_call_errors"] == 4 and metrics["tool_call_errors_mean"] == 2
    assert metrics["env_turns_seen_mean"] == 2.0
    assert metrics["episode_failures"] == {"environment error": 3}


async def test_an_episode_without_a_finite_reward_or_past_its_turns_fails(tiny_llama, tmp_path):
    async def no_reward(client, prompt):
        await _turns_env(1, [])(client, prompt)
        return float("nan")

    async with served(tiny_llama, tmp_path, overrides=("task.max_turns=1", "trainer.max_group_retries=0")) as s:
        for env, reason in ((no_reward, "bad reward"), (_turns_env(2, []), "environment error")):
            runner = EpisodeRunner(s.config, s.state, s.url, env)
            assert await runner.group("g", PROMPT, 1, seed=0, sampling={}) is None
            assert list(runner.failures) == [reason]
            await runner.aclose()
        # the turn past task.max_turns was refused before it ran: an episode's work is bounded
        assert "took its 1 turns (task.max_turns)" in runner.last_failure and "400" in runner.last_failure
        assert len(s.state.router.episodes) == 0


async def test_a_run_whose_every_group_is_dropped_ends_with_the_last_failure():
    class Failing:  # a runner whose every group is dropped
        last_failure, started = "environment error: RuntimeError: sandbox down", 0

        async def group(self, *args):
            self.started += 1
            return None

    config = load_config(None, ["trainer.batch_groups=2", "trainer.group_size=2", "trainer.max_groups_in_flight=4"])
    runner = Failing()
    feeder = EpisodeFeeder(config, runner, PromptCycle([[]] * 4, builtin_prompts(4), 0), None)  # type: ignore[arg-type]
    with pytest.raises(BaseExceptionGroup) as caught:
        await feeder.run()
    leaf = caught.value
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, TrainerError) and "9 groups in a row were dropped" in str(leaf)
    assert "sandbox down" in str(leaf)
    assert 9 <= feeder.drops.total["failed"] <= runner.started <= 9 + 2 * 4  # bounded: a batch or two of 4 in flight
    assert leaf.exit_code == 2  # refused, not restarted: it would fail the same way
    assert feeder.admission.submitted == 0  # dropped groups give their place back


async def test_a_tool_set_that_changes_between_turns_trains_the_turn_as_its_own_sequence(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint(max_position_embeddings=2048)  # room for two tools' descriptions in bytes
    other = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}

    async def changing(client, prompt):
        messages = [{"role": "user", "content": prompt.question}]
        for tools in ([TOOL], [TOOL, other]):
            reply = await client.chat.completions.create(model=prompt.model, messages=messages, tools=tools,
                                                         **{**prompt.sampling, "max_tokens": 5})
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "go on"}]
        return 1.0

    async with served(model_dir, tmp_path) as s:
        runner = EpisodeRunner(s.config, s.state, s.url, changing)
        episodes = [await runner.episode(PROMPT, seed, {"temperature": 1.0}) for seed in (1, 2)]
        await runner.aclose()
        assert s.state.router.transcripts.outcomes == {"tools_changed": 2}
    for e in episodes:
        first, second = e.segments  # the second turn's prompt was rendered whole, with the new tools
        assert first.prompt_token_ids == e.turns[0].prompt_token_ids and first.token_ids == e.turns[0].token_ids
        assert second.prompt_token_ids == e.turns[1].prompt_token_ids and all(second.trained)
    _, batch = pack_episode_groups([EpisodeGroup("g", PROMPT, episodes)], normalize_std=True, fill_version=0)
    assert batch.input_ids.shape[0] == 3  # the shared first prompt, and each episode's second
    assert int(batch.loss_mask.sum()) == sum(len(t.token_ids) for e in episodes for t in e.turns)
    ckpt = load_checkpoint(model_dir, torch.float32)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    with torch.no_grad():
        logprobs = response_logprobs(model, batch, torch.arange(3))
    assert logprobs[batch.loss_mask] == pytest.approx(batch.behavior_logprobs[batch.loss_mask], abs=2e-3)
