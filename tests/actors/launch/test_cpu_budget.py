"""The launcher's CPU budget: threads per role from the cores present, for unset thread counts only."""

from __future__ import annotations

import pytest

from specroll.actors.config import load_config
from specroll.actors.launch.cpu_budget import budget_line, with_cpu_budget


@pytest.mark.parametrize(("cores", "count", "trainer", "generator", "borrow"),
                         [(1, 1, 1, 1, 0), (2, 1, 1, 1, 1), (2, 2, 1, 1, 1), (3, 1, 2, 1, 1), (8, 1, 4, 4, 4),
                          (8, 2, 4, 2, 4)])
def test_the_trainer_gets_half_the_cores_and_the_generators_share_the_rest(cores: int, count: int, trainer: int,
                                                                           generator: int, borrow: int) -> None:
    config = with_cpu_budget(load_config(None, [f"generator.count={count}"]), cores)
    assert config.trainer.train_threads == trainer
    assert config.generator.engine.num_threads == generator
    assert config.trainer.borrow_threads == borrow  # the generators' cores, never beyond the machine's
    line = budget_line(config, cores)
    assert f"on {cores} core(s): trainer {trainer} thread(s)" in line
    assert f"{count} generator(s) x {generator}" in line
    assert (f"(+{borrow} while the generators are idle)" in line) == (borrow > 0)


def test_set_thread_counts_are_kept_and_bad_core_counts_refused() -> None:
    config = load_config(None, ["trainer.train_threads=3", "generator.engine.num_threads=5",
                                "trainer.borrow_threads=0"])
    budgeted = with_cpu_budget(config, 2)
    assert (budgeted.trainer.train_threads, budgeted.generator.engine.num_threads) == (3, 5)
    assert budgeted.trainer.borrow_threads == 0
    with pytest.raises(ValueError, match="cores=0"):
        with_cpu_budget(config, 0)


def test_generators_are_idle_only_while_no_group_is_queued_or_generating() -> None:
    from specroll.actors.rollout.client import RolloutClient
    from specroll.protocol.sampling import SamplingParams

    client = RolloutClient()  # not started: the coordinator alone
    c = client.coordinator
    assert client.generators_idle()
    c.add_generator("g")
    c.on_heartbeat("g", free_groups=4, policy_version=0)
    group = c.add_group([1, 2], 1, SamplingParams(), lane="eval")
    assert not client.generators_idle()  # queued
    c.dispatch()
    assert not client.generators_idle()  # generating
    c.abort(group)
    assert client.generators_idle()
