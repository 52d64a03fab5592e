"""The launcher's CPU budget: threads per role from the cores present, for unset thread counts only."""

from __future__ import annotations

import pytest

from specroll.actors.config import load_config
from specroll.actors.launch.cpu_budget import budget_line, with_cpu_budget


@pytest.mark.parametrize(("cores", "count", "trainer", "generator"),
                         [(1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 1, 1), (3, 1, 2, 1), (8, 1, 4, 4), (8, 2, 4, 2)])
def test_the_trainer_gets_half_the_cores_and_the_generators_share_the_rest(cores: int, count: int, trainer: int,
                                                                           generator: int) -> None:
    config = with_cpu_budget(load_config(None, [f"generator.count={count}"]), cores)
    assert config.trainer.train_threads == trainer
    assert config.generator.engine.num_threads == generator
    assert f"on {cores} core(s): trainer {trainer} thread(s), {count} generator(s) x {generator}" \
        in budget_line(config, cores)


def test_set_thread_counts_are_kept_and_bad_core_counts_refused() -> None:
    config = load_config(None, ["trainer.train_threads=3", "generator.engine.num_threads=5"])
    budgeted = with_cpu_budget(config, 2)
    assert (budgeted.trainer.train_threads, budgeted.generator.engine.num_threads) == (3, 5)
    with pytest.raises(ValueError, match="cores=0"):
        with_cpu_budget(config, 0)
