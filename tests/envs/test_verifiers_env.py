"""``verifiers`` environments (``specroll.envs.verifiers_env``): the taskset's tasks are the run's
prompts; a single-turn and a tool-using taskset (``tests/helpers/vf_arith.py``, ``vf_calc.py``) run
through specroll's real server in front of a real generator process, as the trainer runs episodes
(the turns the server recorded under verifiers' own session id, the reward of its rubric: a tiny
model taught the answer in the test scores 1); and a verifiers environment end to end in a launched
run. Skipped where verifiers is not installed, except the checks of what happens then."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import httpx2 as httpx
import pytest
import torch
from helpers.checkpoints import write_tiny_checkpoint
from helpers.launch import assert_nothing_left, children_of, finish, launch, write_config
from helpers.server import HANG_S, served
from helpers.timeouts import guard

from specroll.actors.config import load_config
from specroll.actors.trainer.episodes import EpisodeRunner
from specroll.actors.trainer.task_load import load_environment, load_task
from specroll.envs.base import EnvironmentLoadError
from specroll.rl.tasks import Prompt

TESTS = Path(__file__).resolve().parents[1]
needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                     reason="verifiers is not installed (pip install 'specroll[verifiers]')")
ARITH, CALC = "verifiers:helpers.vf_arith", "verifiers:helpers.vf_calc"
GREEDY = {"temperature": 0.0, "max_tokens": 120}
CALL = '<tool_call>\n{"name": "calculator_calculate", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def tool_path(monkeypatch) -> None:
    """``tests/`` on the PYTHONPATH of the processes verifiers starts (the tool server)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


def _teach(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], steps: int = 400) -> None:
    """Teacher-force each (prompt, answer) until the model says every answer greedily."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        losses = []
        for prompt, answer in examples:
            ids = torch.tensor([prompt + answer])
            labels = ids.clone()
            labels[0, : len(prompt)] = -100
            losses.append(model(input_ids=ids, labels=labels).loss)
        loss = torch.stack(losses).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if max(x.item() for x in losses) < 0.01:
            break
    model.eval()


async def _publish(http: httpx.AsyncClient, model: torch.nn.Module, weights_dir: Path, version: int) -> None:
    model.save_pretrained(weights_dir / f"v{version}")
    reply = await http.post("/update_weights", json={"path": f"v{version}"})
    assert reply.status_code == 200 and reply.json() == {"policy_version": version}


async def _tokens(http: httpx.AsyncClient, text: str) -> list[int]:
    return (await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]


def test_the_tasksets_tasks_are_the_runs_prompts_split_as_a_prompt_files(tmp_path) -> None:
    pytest.importorskip("verifiers", reason="verifiers is not installed (pip install 'specroll[verifiers]')")
    from helpers.vf_arith import QUESTIONS

    def split(*overrides: str):
        return load_task(load_config(None, [f'task.environment="{ARITH}"', f'run_dir="{tmp_path}"', *overrides]))

    expected = [Prompt(i, q, str(a)) for i, q, a in QUESTIONS]
    held = split("eval.every=1", "eval.count=1")
    assert (held.train, held.eval) == (expected[:3], expected[3:])
    assert (split("eval.every=0").train, split("eval.every=0", "task.max_prompts=2").train) == \
        (expected, expected[:2])
    with pytest.raises(ValueError, match="brings its own prompts"):
        split('task.prompts="x.jsonl"')
    with pytest.raises(EnvironmentLoadError, match=r"'helpers\.no_such_tasks' does not import"):
        split('task.environment="verifiers:helpers.no_such_tasks"')


def test_without_verifiers_the_environment_names_the_extra(tmp_path, monkeypatch) -> None:
    for name in ("verifiers", "verifiers.v1"):  # as if it were not installed
        monkeypatch.setitem(sys.modules, name, None)
    config = load_config(None, [f'task.environment="{ARITH}"', f'run_dir="{tmp_path}"'])
    for load in (load_environment, load_task):
        with pytest.raises(EnvironmentLoadError, match=r"pip install 'specroll\[verifiers\]'"):
            load(config)


@needs_verifiers
@pytest.mark.anyio
@pytest.mark.integration
async def test_a_single_turn_verifiers_task_runs_through_the_server_and_its_rubric_scores_it(tmp_path) -> None:
    from specroll.envs.verifiers_env import VerifiersEnv

    model_dir = tmp_path / "taught"
    model_dir.mkdir()
    policy = write_tiny_checkpoint(model_dir, max_position_embeddings=1024)
    prompt = Prompt("six-times-seven", "What is 6 * 7?", "42")
    env = VerifiersEnv(ARITH, max_turns=4)
    async with served(model_dir, tmp_path) as s, \
            httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S) as http:
        runner = EpisodeRunner(s.config, s.state, s.url, env)
        before = await runner.episode(prompt, 1, GREEDY)  # the random model: one turn, recorded
        (turn,) = before.turns
        from helpers.vf_arith import SYSTEM
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt.question}]
        assert turn.prompt_token_ids == (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
        assert before.metrics["turns"] == 1 and before.metrics["tool_calls"] == 0
        assert before.metrics["metric_reply_chars"] > 0
        answer = await _tokens(http, "#### 42")
        _teach(policy, [(turn.prompt_token_ids, [*answer, 2])])  # then <|im_end|>: the end of the turn
        await _publish(http, policy, s.weights_dir, 1)
        after = await runner.episode(prompt, 2, GREEDY)
        assert len(s.state.router.episodes) == 0  # every session closed, verifiers' too
        await env.aclose()
        await runner.api.close()
    (turn,) = after.turns
    assert turn.token_ids[:-1] == answer and set(turn.versions) == {1}
    assert after.reward == 1.0 and before.reward == 0.0  # the task's @vf.reward, read off its trace


@needs_verifiers
@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning")  # verifiers' MCP client
async def test_a_tool_using_verifiers_task_takes_its_turns_through_the_server(tmp_path, tool_path) -> None:
    from specroll.envs.verifiers_env import VerifiersEnv

    model_dir = tmp_path / "taught"
    model_dir.mkdir()
    policy = write_tiny_checkpoint(model_dir, max_position_embeddings=2048)
    prompt = Prompt("six-times-seven", "What is 6 * 7?", "42")
    env = VerifiersEnv(CALC, max_turns=3)
    async with served(model_dir, tmp_path, overrides=("task.max_turns=3",)) as s, \
            httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S) as http:
        runner = EpisodeRunner(s.config, s.state, s.url, env)
        first = (await runner.episode(prompt, 1, GREEDY)).turns[0]  # the random model's first turn
        shown = (await http.post("/detokenize", json={"tokens": first.prompt_token_ids})).json()["prompt"]
        assert "calculator_calculate" in shown and prompt.question in shown  # the MCP tool, offered
        call, answer = await _tokens(http, CALL), await _tokens(http, "#### 42")
        _teach(policy, [(first.prompt_token_ids, [*call, 2])])
        await _publish(http, policy, s.weights_dir, 1)
        called = await runner.episode(prompt, 2, GREEDY)  # calls the tool; what it says next is untaught
        assert called.turns[0].tool_calls == 1 and len(called.turns) >= 2
        _teach(policy, [(first.prompt_token_ids, [*call, 2]), (called.turns[1].prompt_token_ids, [*answer, 2])])
        await _publish(http, policy, s.weights_dir, 2)
        episode = await runner.episode(prompt, 3, GREEDY)
        shown = (await http.post("/detokenize", json={"tokens": episode.turns[1].prompt_token_ids})).json()["prompt"]
        assert len(s.state.router.episodes) == 0
        await env.aclose()
        await runner.api.close()
    assert [(t.tool_calls, t.token_ids[:-1]) for t in episode.turns] == [(1, call), (0, answer)]
    assert "42" in shown.rpartition("</tool_call>")[2]  # the tool's result, computed by the toolset's process
    assert len(episode.segments) == 1  # turn 2's prompt continued turn 1's tokens (token-in-token-out)
    assert episode.reward == 1.0 and called.reward == 0.0
    assert episode.metrics["turns"] == 2 and episode.metrics["tool_calls"] == 1


@needs_verifiers
@pytest.mark.integration
@pytest.mark.slow
def test_a_verifiers_environment_end_to_end_in_a_launched_run(tmp_path, tiny_checkpoint, tool_path) -> None:
    config = write_config(tmp_path, tiny_checkpoint(max_position_embeddings=1024), steps=2, count=1,
                          eval_every=2)
    config.write_text(config.read_text().replace("count = 4\n", "count = 1\n")
                      + f'\n[task]\nenvironment = "{CALC}"\nmax_turns = 2\n\n[server]\nport = 0\n')
    before = children_of(os.getpid())
    code, _, err = finish(launch(tmp_path, config), timeout=guard(300))
    run_dir = tmp_path / "run"
    assert code == 0, err
    assert_nothing_left(run_dir, before)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and not r.get("skipped")]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    for r in steps:
        assert r["episodes"] == 2 and r["trained_tokens"] > 0 and r["groups_dropped_total"] == 0
        assert 1 <= r["turns_mean"] <= 2 and r["env_turns_mean"] == r["turns_mean"]
        assert "env_tool_calls_mean" in r and r["episode_failures"] == {}
