"""A trainer restarted before its first checkpoint: an earlier incarnation's metrics lines (or a
trainer restart the launcher recorded) send it down the resume path — wait for the generators'
versions, publish its initial weights above them, drop the old lines it writes again — while a first
start on an empty run directory publishes nothing before its first step. Then ``truncate_metrics``
on a step evaluated again: no duplicate line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.trainer_runs import trainer_without_generators

from specroll.actors.shared.restarts import write_restarts
from specroll.actors.trainer.metrics import METRICS_FILENAME, truncate_metrics
from specroll.actors.trainer.trainer import Trainer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _start(trainer: Trainer, serving: int | None) -> list[int]:
    """Run ``trainer`` up to its first step (which then ends the run), a stand-in generator serving
    ``serving``; the versions it published before that step."""
    published: list[int] = []

    async def publish() -> None:
        published.append(trainer.version)

    async def nothing(*_: object) -> None:
        pass

    async def last_step(*_: object) -> None:
        trainer.step = trainer.checkpoints.last_step = trainer.config.steps

    trainer._publish, trainer._wait_acks, trainer._one_step = publish, nothing, last_step  # type: ignore[method-assign]
    trainer.client.wait_for_generators = nothing  # type: ignore[method-assign]
    if serving is not None:
        trainer.client.coordinator.add_generator("stand-in")
        trainer.client.coordinator.on_heartbeat("stand-in", free_groups=0, policy_version=serving)
    await trainer.run()
    return published


@pytest.mark.anyio
@pytest.mark.parametrize("left", ["metrics", "restarts", "nothing"])
async def test_a_trainer_killed_before_its_first_checkpoint_starts_again_above_the_served_version(
        tiny_checkpoint, tmp_path: Path, left: str) -> None:
    async with trainer_without_generators(tiny_checkpoint("llama"), tmp_path, eval__every=2, eval__count=2,
                        task__builtin_count=16) as trainer:
        metrics = trainer.run_dir / METRICS_FILENAME
        if left == "metrics":  # the old incarnation evaluated step 0 and trained step 1 (version 1)
            metrics.write_text(json.dumps({"step": 0, "policy_version": 0, "eval_accuracy": 0.5}) + "\n"
                               + json.dumps({"step": 1, "policy_version": 1, "loss": 0.1}) + "\n")
        elif left == "restarts":
            write_restarts(trainer.run_dir, {"trainer": 1})
        published = await _start(trainer, serving=None if left == "nothing" else 1)
        assert trainer.resumed_from is None
        if left == "nothing":  # a first start: no wait, no publish before the first step
            assert published == [] and not metrics.exists()
        else:
            assert published == [2]  # above the version the generator serves, before evaluating step 0
            # the old step-0 evaluation and step 1 are written again, not repeated
            assert not metrics.exists() or metrics.read_text() == ""
            assert trainer._held is not None and (trainer._held["step"], trainer._held["policy_version"]) == (0, 2)


def test_the_line_of_a_step_evaluated_again_is_written_once(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILENAME
    records = [{"step": 0, "eval_accuracy": 0.1}, {"step": 1, "loss": 0.5}, {"step": 2, "skipped": True},
               {"step": 2, "loss": 0.4, "eval_accuracy": 0.2, "eval_step": 2}, {"step": 3, "loss": 0.3}]
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text)
    assert truncate_metrics(path, 2) is None  # not evaluated again: the step's line stays
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:4]
    path.write_text(text)
    held = truncate_metrics(path, 2, evaluated_again=True)  # its line comes back, to be held and rewritten
    assert held == {"step": 2, "loss": 0.4}
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]
    path.write_text(text)
    assert truncate_metrics(path, 0, evaluated_again=True) is None  # step 0's line is an evaluation's only
    assert path.read_text() == ""
    path.write_text(text)
    assert truncate_metrics(path, 0) is None
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:1]
