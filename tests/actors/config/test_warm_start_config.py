"""``[drafter]``'s warm-start settings are checked when the config loads, naming the key."""

from __future__ import annotations

import pytest

from specroll.actors.config import ConfigError, DrafterConfig, RunConfig, load_config


@pytest.mark.parametrize(("override", "message"), [
    ("drafter.warm_start_minutes=-1", "drafter.warm_start_minutes=-1.0, expected CPU-minutes in [0, 10080]"),
    ("drafter.warm_start_minutes=nan", "drafter.warm_start_minutes=nan, expected CPU-minutes"),
    ("drafter.warm_start_minutes=inf", "drafter.warm_start_minutes=inf, expected CPU-minutes"),
    ("drafter.warm_start_rollouts=0", "drafter.warm_start_rollouts=0, expected an integer in [1, 100000]"),
    ("drafter.warm_start_rollouts=100000000000", "drafter.warm_start_rollouts=100000000000, expected an integer"),
    ("drafter.warm_start_cache_dir=\" \"", "drafter.warm_start_cache_dir=' ', expected a directory path"),
    ("drafter.warm_start_minutes=\"3\"", "drafter.warm_start_minutes: expected `float`, got `str`"),
])
def test_bad_warm_start_settings_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.environment=calculator"], "expected 0 with task.environment = 'calculator'"),
    (["cluster.backend=ray"], "expected 0 with cluster.backend = 'ray'"),
])
def test_a_warm_start_needs_a_single_turn_task_on_this_host(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["drafter.warm_start_minutes=2", *overrides])
    assert f"drafter.warm_start_minutes=2.0, {message}" in str(info.value)
    load_config(None, ["drafter.warm_start_minutes=0", *overrides])  # off: no objection


def test_good_warm_start_settings_load() -> None:
    config = load_config(None, ["drafter.warm_start_minutes=2.5", "drafter.warm_start_rollouts=64",
                                "drafter.warm_start_cache_dir=\"~/drafters\""])
    assert (config.drafter.warm_start_minutes, config.drafter.warm_start_rollouts) == (2.5, 64)
    assert config.drafter.warm_start_cache_dir == "~/drafters"
    assert RunConfig().drafter.warm_start_minutes == 0.0  # off by default
    with pytest.raises(ValueError, match="warm_start_rollouts=-3"):  # built in code: the same checks
        DrafterConfig(warm_start_rollouts=-3)
