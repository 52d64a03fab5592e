"""Bounds checked at load: every count, size and duration a config sets has an upper bound, named with
the key and the value in the error (a config value must never make an actor do unbounded work); and a
key that moved names where it went."""

from __future__ import annotations

from pathlib import Path

import pytest

from specroll.actors.config import ConfigError, load_config

# (override, the message's substring: the key, the value and the bound)
UPPER_BOUNDS = [
    ("steps=10000001", "steps=10000001, expected an integer in [1, 10000000]"),
    ("launch.max_restarts=1001", "launch.max_restarts=1001, expected an integer in [0, 1000]"),
    ("launch.restart_window_s=1e9", "launch.restart_window_s=1000000000.0, expected a number of seconds in "
                                    "(0, 604800]"),
    ("launch.restart_backoff_max_s=inf", "launch.restart_backoff_max_s=inf, expected a number of seconds in [0, 3600]"),
    ("trainer.batch_groups=70000", "trainer.batch_groups=70000, expected an integer in [1, 65536]"),
    ("trainer.group_size=70000", "trainer.group_size=70000, expected an integer in [2, 65536]"),
    ("trainer.max_staleness=10001", "trainer.max_staleness=10001, expected an integer in [0, 10000]"),
    ("trainer.max_groups_in_flight=2000000", "trainer.max_groups_in_flight=2000000, expected an integer in "
                                             "[batch_groups = 4, 1048576]"),
    ("trainer.max_group_retries=101", "trainer.max_group_retries=101, expected an integer in [0, 100]"),
    ("trainer.max_group_retries=-1", "trainer.max_group_retries=-1, expected an integer in [0, 100]"),
    ("trainer.max_queued_groups=0", "trainer.max_queued_groups=0, expected an integer in [1, 1048576]"),
    ("trainer.max_queued_groups=2000000", "trainer.max_queued_groups=2000000, expected an integer in [1, 1048576]"),
    ("trainer.max_queued_groups=50", "trainer.max_queued_groups=50, expected at least trainer.max_groups_in_flight "
                                     "+ eval.count + server.max_requests_in_flight = 8 + 64 + 0 = 72"),  # no server
    ("generator.count=1025", "generator.count=1025, expected an integer in [1, 1024]"),
    ("generator.sampling.max_tokens=2000000", "generator.sampling.max_tokens=2000000, expected an integer in "
                                              "[1, 1048576]"),
    ("generator.stream_every_steps=100000", "generator.stream_every_steps=100000, expected an integer in [1, 65536]"),
    ("generator.stats_s=1e6", "generator.stats_s=1000000.0, expected a number of seconds in (0, 3600]"),
    ("generator.linger_s=61", "generator.linger_s=61.0, expected a number of seconds in (0, 60]"),
    ("generator.max_outbox=100000", "generator.max_outbox=100000, expected an integer in [1, 65536]"),
    ("generator.engine.max_num_seqs=100000", "generator.engine.max_num_seqs=100000, expected an integer in [1, 65536]"),
    ("generator.engine.kv_cache_memory_gb=1e9", "generator.engine.kv_cache_memory_gb=1000000000.0, expected a number "
                                                "of GiB in (0, 4096]"),
    ("generator.engine.max_model_len=2000000", "generator.engine.max_model_len=2000000, expected an integer in "
                                               "[1, 1048576] or None"),
    ("generator.engine.max_num_batched_tokens=2000000", "generator.engine.max_num_batched_tokens=2000000, expected an "
                                                        "integer in [1, 1048576]"),
    ("drafter.window_rollouts=2000000", "drafter.window_rollouts=2000000, expected an integer in [1, 1000000]"),
    ("drafter.batch=5000", "drafter.batch=5000, expected an integer in [1, 4096]"),
    ("drafter.ttt_steps=33", "drafter.ttt_steps=33, expected an integer in [1, 32]"),
    ("drafter.min_rollouts=300", "drafter.min_rollouts=300, expected at most window_rollouts = 256"),
    ("drafter.kv_cache_gb=inf", "drafter.kv_cache_gb=inf, expected a number of GiB in (0, 1024]"),
    ("drafter.linger_s=100", "drafter.linger_s=100.0, expected a number of seconds in (0, 60]"),
    ("network.hwm=2000000", "network.hwm=2000000, expected an integer in [1, 1000000]"),
    ("network.heartbeat_timeout_s=1e6", "network.heartbeat_timeout_s=1000000.0, expected a number of seconds in "
                                        "(0, 86400]"),
    ("network.weights_bucket_mb=20000", "network.weights_bucket_mb=20000, expected an integer in [1, 16384]"),
    ("server.max_requests_in_flight=100000", "server.max_requests_in_flight=100000, expected an integer in [1, 65536]"),
    ("server.request_timeout_s=inf", "server.request_timeout_s=inf, expected a number of seconds in (0, 86400]"),
    ("server.body_timeout_s=nan", "server.body_timeout_s=nan, expected a number of seconds in (0, 3600]"),
    ("server.session_ttl_s=1e9", "server.session_ttl_s=1000000000.0, expected a number of seconds in (0, 604800]"),
    ("server.max_sessions=2000000", "server.max_sessions=2000000, expected an integer in [1, 1048576]"),
    ("eval.count=100001", "eval.count=100001, expected an integer in [1, 100000]"),
    ("task.builtin_count=2000000", "task.builtin_count=2000000, expected an integer in [1, 1048576]"),
    ("cluster.placement_timeout_s=1e6", "cluster.placement_timeout_s=1000000.0, expected a number of seconds in "
                                        "(0, 86400]"),
    ("cluster.generator.num_gpus=5000", "cluster.generator.num_gpus=5000.0, expected a number in [0, 4096]"),
]


@pytest.mark.parametrize(("override", "expected"), UPPER_BOUNDS, ids=[o for o, _ in UPPER_BOUNDS])
def test_every_count_size_and_duration_is_bounded_at_load(tmp_path: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value), str(info.value)


def test_a_moved_key_names_where_it_went(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[task]\nmax_retries = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key task.max_retries; it moved to trainer.max_group_retries"):
        load_config(path)
    assert load_config(None, ["trainer.max_group_retries=0", "trainer.dropped_prompts='retry'"]).trainer \
        .dropped_prompts == "retry"
