"""The trainer's held-out evaluation and its synchronous mode, with real generator processes on a tiny
random-weight checkpoint (helpers from ``helpers/trainer_runs.py``); both are checked on what the run wrote:
``metrics.jsonl`` and ``timeline.jsonl``. Then its feeder's staleness window and a batch with every
token stale, with a stand-in for the generator that decides which version sampled each token.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anyio
import pytest
import torch
from helpers.timeouts import guard
from helpers.trainer_runs import free_port, generators, metrics, run_config, trainer_without_generators, wait_for
from tqdm import tqdm

from specroll.actors.launch.metrics_tail import format_metrics
from specroll.actors.launch.preflight import preflight
from specroll.actors.rollout.timeline import TIMELINE_FILENAME
from specroll.actors.trainer.process import ENDPOINT_FILENAME, run_trainer
from specroll.actors.trainer.setup import TrainerError
from specroll.actors.trainer.trainer import Trainer
from specroll.engine.config import EngineConfig
from specroll.engine.engine import Engine
from specroll.protocol.messages import RolloutChunk
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import Group
from specroll.rl.evaluation import evaluate_engine
from specroll.rl.grpo_step import StepResult
from specroll.rl.tasks import builtin_task, format_question, gsm8k_reward


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _run(model: Path, tmp_path: Path, count: int = 1, **extra: object) -> Path:
    """A whole run: the trainer in-process, ``count`` generator processes loaded before it starts."""
    run, port = tmp_path / "run", free_port()
    config = run_config(run, model, network__trainer_port=port, **extra)
    result: dict[str, int] = {}

    async def trainer() -> None:
        result["code"] = await run_trainer(config)

    def loaded(i: int) -> bool:
        log = tmp_path / f"gen-{i}.log"
        return log.exists() and "connecting to" in log.read_text()

    with generators(f"tcp://127.0.0.1:{port}", model, tmp_path, count=count) as procs:
        await wait_for(lambda: all(loaded(i) for i in range(count)), guard(120), "the generators to load", procs)
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            await wait_for(lambda: (run / ENDPOINT_FILENAME).exists() or "code" in result, guard(60), "the endpoint")
            await wait_for(lambda: "code" in result, guard(180), "the trainer to finish", procs)
    assert result["code"] == 0
    return run


def _timeline(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / TIMELINE_FILENAME).read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.anyio
async def test_held_out_evaluation_runs_on_generators_and_is_never_trained_on(tiny_checkpoint, tmp_path: Path) -> None:
    steps, every, count = 5, 2, 8  # the last step right after an evaluated one: two evaluations back to back
    model = tiny_checkpoint("llama")
    run = await _run(model, tmp_path, count=2, steps=steps, eval__every=every, eval__count=count,
                     task__builtin_count=64, trainer__max_groups_in_flight=4)
    lines = metrics(run)
    # before training (a line of its own), after step 2 and after the last step, each in the line
    # of the step whose weights it measured
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4, 5]
    for m in lines[1:]:  # the optimizer step is part of the step's time; borrowing is a share of its phases
        assert 0 < m["train_s"] <= m["step_s"], m
        assert m["threads_borrowed"] is None or 0 <= m["threads_borrowed"] <= 1, m
    evaluated = {m["step"]: m for m in lines if "eval_accuracy" in m}
    assert sorted(evaluated) == [0, 2, 4, 5]
    assert all(m["eval_step"] == step for step, m in evaluated.items())
    for m in evaluated.values():
        version = m["eval_policy_version"]
        assert version == m["eval_step"]  # a fresh run: policy version = steps taken
        assert m["eval_versions"] == [version, version]  # every token from the evaluated weights
        assert m["eval_prompts"] == count and 0.0 <= m["eval_accuracy"] <= 1.0

    # the generators' evaluation of the untrained weights is the one a local engine computes
    # (same sampling, same per-prompt seeds): the benchmark evaluates other trainers' weights this way
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=0.02))
    split = builtin_task(64, 0, eval_count=count)
    prompts = [(p, engine.tokenizer.encode_chat(format_question(p.question, split.instruction))) for p in split.eval]
    local = evaluate_engine(engine, prompts, SamplingParams(max_tokens=16), gsm8k_reward)
    assert local.response_tokens_mean == lines[0]["eval_response_tokens_mean"]
    assert local.accuracy == lines[0]["eval_accuracy"]

    events = _timeline(run)
    held_out = {p.prompt_id for p in builtin_task(64, 0, eval_count=count).eval}
    trained = [pid for e in events if e["event"] == "step_groups" for pid in e["prompt_ids"]]
    # a batch with every token too stale is no step and another is drawn: how many, depends on timing
    redrawn = sum(1 for m in metrics(run, skipped=True) if m.get("skipped"))
    assert lines[0]["policy_version"] == 0 and "reward_mean" not in lines[0]
    assert len(trained) == (steps + redrawn) * 2  # batch_groups = 2
    assert not held_out & set(trained)  # no evaluation prompt was ever trained on
    finished_eval = [e for e in events if e["event"] == "group_finished" and e["lane"] == "eval"]
    assert len(finished_eval) == 4 * count
    assert [e["step"] for e in events if e["event"] == "evaluation"] == [0, 2, 4, 5]
    # an evaluation holds the next publish: no version is published while one runs
    for e in events:
        if e["event"] == "evaluation" and e["step"] < steps:
            published = [p["t"] for p in events if p["event"] == "policy_published" and p["version"] == e["step"] + 1]
            assert published and published[0] >= e["t"]


@pytest.mark.integration
@pytest.mark.anyio
async def test_sync_mode_trains_only_after_every_rollout_of_the_step_finished(tiny_checkpoint,
                                                                               tmp_path: Path) -> None:
    steps = 3
    run = await _run(tiny_checkpoint("llama"), tmp_path, count=2, steps=steps, trainer__mode="sync",
                     trainer__max_groups_in_flight=8, generator__sampling__max_tokens=32)
    events = _timeline(run)
    finished = {e["group_id"]: e["t"] for e in events if e["event"] == "group_finished" and e["lane"] == "train"}
    trains = [e for e in events if e["event"] == "phase" and e["phase"] == "train"]
    batches = [e for e in events if e["event"] == "step_groups"]
    assert [e["step"] for e in trains] == [e["step"] for e in batches] == [1, 2, 3]
    # exactly the step's groups were generated, all finished before it trained, none during training
    assert sorted(finished) == sorted(g for b in batches for g in b["group_ids"])
    for train, batch in zip(trains, batches, strict=True):
        assert max(finished[g] for g in batch["group_ids"]) <= train["start"]
        assert not [g for g, t in finished.items() if train["start"] <= t <= train["end"]]
    lines = metrics(run)
    assert all(m["staleness"] == {"0": m["trained_tokens"]} for m in lines)  # on-policy: every token lag 0
    # every generator served the new weights before the next step's rollouts began
    assert all(v == steps for v in lines[-1]["generator_versions"].values())
    assert all(m["logprob_mismatch_tokens"] == m["trained_tokens"] for m in lines)
    assert all(m["logprob_diff_max"] <= 1e-4 for m in lines), [m["logprob_diff_max"] for m in lines]


# ---- the feeder's staleness window and batches with nothing to train ------------------------


def _finish(trainer: Trainer, count: int, version: int) -> None:
    """Finish the ``count`` oldest queued groups, every token sampled by policy ``version``: a generator
    added to the coordinator, handed them, and removed again without an ``await`` in between, so the
    client never sends it anything (its other groups go back to the queue)."""
    c = trainer.client.coordinator
    c.add_generator("stand-in")
    c.on_heartbeat("stand-in", free_groups=count, policy_version=version)
    for _, msg in c.dispatch():
        for i in range(msg.n):
            c.on_chunk("stand-in", RolloutChunk(group_id=msg.group_id, sample_index=i, offset=0, token_ids=[5, 6],
                                                logprobs=[-1.0, -1.0], versions=[version] * 2, finished=True,
                                                finish_reason="stop"))
    c.remove_generator("stand-in")


@pytest.mark.anyio
async def test_the_feeder_keeps_eta_plus_one_batches_ahead_and_a_stale_batch_is_no_step(
        tiny_checkpoint, tmp_path: Path, caplog, capsys) -> None:
    bar = tqdm(disable=True)
    async with trainer_without_generators(tiny_checkpoint("llama"), tmp_path,
                                          trainer__max_groups_in_flight=6) as trainer:
        assert preflight(trainer.config) is None
        assert "warning: trainer.max_groups_in_flight=6 is above" in capsys.readouterr().err
        client = trainer.client

        async def step(version: int) -> None:
            """Finish the two oldest groups as sampled by ``version``, run a step, let the feeder refill."""
            _finish(trainer, 2, version)
            await trainer._one_step(bar, sync=False)
            await anyio.wait_all_tasks_blocked()

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer._feed)
            await anyio.wait_all_tasks_blocked()
            assert "max_groups_in_flight=6 is above" in caplog.text  # the start warning, in trainer.log
            assert client.num_pending == 4  # (η + 1)·B, not max_groups_in_flight
            # the batch being trained still counts: no group is submitted until its step finished
            train, looked = trainer._train, threading.Event()

            def train_once_looked(groups: list[Group], version: int) -> tuple[torch.Tensor, StepResult]:
                looked.wait()
                return train(groups, version)

            trainer._train = train_once_looked  # type: ignore[method-assign]
            _finish(trainer, 2, 0)
            async with anyio.create_task_group() as first:
                first.start_soon(trainer._one_step, bar, False)
                try:
                    await anyio.wait_all_tasks_blocked()  # the step waits for its worker thread
                    during = (trainer.step, client.num_pending, client.num_finished)
                finally:
                    looked.set()
            trainer._train = train  # type: ignore[method-assign]
            assert during == (0, 2, 0)
            await anyio.wait_all_tasks_blocked()
            assert (trainer.step, trainer.version, client.num_pending) == (1, 1, 4)
            await step(0)  # trained as version 1: lag 1 = η
            assert (trainer.step, trainer.version) == (2, 2)

            weights = {k: v.clone() for k, v in trainer.policy.full_weights().items()}
            await step(0)  # trained as version 2: lag 2 > η, every token masked
            assert (trainer.step, trainer.version, client.num_pending) == (2, 2, 4)  # no step, no version
            assert all(torch.equal(weights[k], v) for k, v in trainer.policy.full_weights().items())
            assert "step 3: no token of its batch is trainable (8 masked as stale" in caplog.text
            await step(2)
            assert (trainer.step, trainer.version) == (3, 3)
            assert any(not torch.equal(weights[k], v) for k, v in trainer.policy.full_weights().items())

            await step(0)  # η + 1 = 2 stale batches in a row are possible; a third means something is wrong
            await step(1)
            with pytest.raises(TrainerError, match="3 batches in a row had no token to train"):
                await step(1)
            tg.cancel_scope.cancel()

    lines = metrics(tmp_path / "run", skipped=True)
    assert [(m["step"], m["skipped"], m["trained_tokens"]) for m in lines] == [
        (1, False, 8), (2, False, 8), (3, True, 0), (3, False, 8), (4, True, 0), (4, True, 0)]
    assert [m["policy_version"] for m in lines] == [1, 2, 2, 3, 3, 3]
    assert lines[2]["tokens_masked_stale"] == 8 and lines[2]["loss"] == 0.0
    assert format_metrics(lines[2]).startswith("step 3 skipped (no token to train, not counted): ")
