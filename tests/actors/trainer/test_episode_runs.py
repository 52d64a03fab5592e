"""Episode tasks in launched runs (``specroll launch`` with ``task.environment``) on a tiny model:
examples/agentic_env.py's two-try environment and the built-in calculator task train steps, are
evaluated, and say what their episodes did in every metrics line; the processes leave nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.launch import assert_nothing_left, children_of, finish, launch, write_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("environment", ["agentic_env:second_chance", "calculator"])
def test_a_launched_episode_run_trains_and_reports_its_episodes(tmp_path, tiny_checkpoint, monkeypatch,
                                                                environment) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))
    config = write_config(tmp_path, tiny_checkpoint(max_position_embeddings=2048), steps=2, count=1,
                          eval_every=2)
    config.write_text(config.read_text() + f'\n[task]\nenvironment = "{environment}"\nmax_turns = 3\n'
                      "digits = 2\n\n[server]\nport = 0\n")
    before = children_of(os.getpid())
    code, _, err = finish(launch(tmp_path, config), timeout=300)
    run_dir = tmp_path / "run"
    assert code == 0, err
    assert_nothing_left(run_dir, before)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and not r.get("skipped")]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    for r in steps:
        assert r["episodes"] == 2 and r["trained_tokens"] > 0 and r["groups_dropped_total"] == 0
        assert 1 <= r["turns_mean"] <= 3 and r["episode_tokens_mean"] >= r["response_tokens_mean"] > 0
        # every later turn continued its episode's tokens: one trained sequence per episode
        assert r["sequences_mean"] == 1.0 and set(r["stitch"]) <= {"stitched"}
    key = "env_tries_mean" if environment.startswith("agentic_env") else "env_tool_latency_s_mean"
    assert all(key in r for r in steps)
    assert (run_dir / "server.url").read_text().startswith("http://127.0.0.1:")
