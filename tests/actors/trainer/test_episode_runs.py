"""Episode tasks in launched runs (``specroll launch`` with ``task.environment``) on a tiny model:
examples/agentic_env.py's two-try environment and the built-in calculator task train steps, are
evaluated, and say what their episodes did in every metrics line; the processes leave nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.launch import launched_episode_run

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("environment", ["agentic_env:second_chance", "calculator"])
def test_a_launched_episode_run_trains_and_reports_its_episodes(tmp_path, tiny_checkpoint, monkeypatch,
                                                                environment) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))
    _, steps = launched_episode_run(tmp_path, tiny_checkpoint(max_position_embeddings=2048),
                                    f'environment = "{environment}"\nmax_turns = 3\ndigits = 2')
    for r in steps:
        assert r["episodes"] == 2 and r["trained_tokens"] > 0 and r["groups_dropped_total"] == 0
        assert 1 <= r["turns_mean"] <= 3 and r["episode_tokens_mean"] >= r["response_tokens_mean"] > 0
        # every later turn continued its episode's tokens: one trained sequence per episode
        assert r["sequences_mean"] == 1.0 and set(r["stitch"]) <= {"stitched"}
    key = "env_tries_mean" if environment.startswith("agentic_env") else "env_tool_latency_s_mean"
    assert all(key in r for r in steps)
    assert (tmp_path / "run" / "server.url").read_text().startswith("http://127.0.0.1:")
