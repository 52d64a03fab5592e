"""Every role of a launched run scraped over HTTP and read with ``prometheus_client``'s own parser:
each metric the catalogue lists for the role is there with its type; counters never decrease; a
generator killed and restarted by the launcher serves counters started again while the others go on;
the trainer's figures agree with ``metrics.jsonl``. Real processes, sockets and a tiny random model."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from helpers.launch import (
    assert_nothing_left,
    children_of,
    finish,
    launch,
    started_pids,
    wait_for,
    welcomed,
    with_drafter,
    write_config,
)
from helpers.scrape import Samples, answers, assert_catalogue, scrape, target, value
from helpers.sink_files import event_files, read_wandb_run, scalars
from helpers.timeouts import guard

pytestmark = pytest.mark.integration

ROLES = {"trainer": "trainer", "generator-0": "generator", "generator-1": "generator", "drafter-0": "drafter"}


def counters(samples: Samples, types: dict[str, str]) -> Samples:
    return {k: v for k, v in samples.items() if types.get(k[0].removesuffix("_total")) == "counter"
            and k[0].endswith("_total")}


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def trained(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r and not r["skipped"]]


def test_every_role_is_scraped_with_the_catalogue_and_agrees_with_metrics_jsonl(
        tmp_path: Path, tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # offline anyway; closed if it were not
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    config = with_drafter(write_config(tmp_path, tiny_checkpoint(), steps=1_000_000, count=2), duty_cycle=0.5)
    config.write_text(config.read_text() + """
[launch]
max_restarts = 3
restart_backoff_s = 0.2

[metrics]
enabled = true
port = 0
wandb = true
tensorboard = true
""")
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    run_dir = tmp_path / "run"
    try:
        # welcomed: each peer's actor is made (a scrape before reads an endpoint with no actor behind it yet)
        wait_for(lambda: all(target(run_dir, a) for a in ROLES)
                 and all(welcomed(run_dir, log) for log in ("generator-0", "generator-1", "drafter"))
                 and (run_dir / "metrics.jsonl").exists() and len(trained(run_dir)) >= 3,
                 "every role's endpoint, every peer welcomed and 3 trained steps", proc, timeout=guard(300))

        # every listed metric, with its type, on every role
        first = {actor: scrape(run_dir, actor) for actor in ROLES}
        for actor, role in ROLES.items():
            assert_catalogue(first[actor], role)  # type: ignore[arg-type]
            assert value(first[actor][1], "specroll:role_info", role=role, actor=actor) == 1
        _, gen = first["generator-0"]
        assert value(gen, "vllm:num_requests_running", engine="0") >= 0
        assert {ls for (n, ls) in gen if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}  # positions

        # the trainer agrees with metrics.jsonl: its step's line, and the sums of the lines up to it
        _, tr = scrape(run_dir, "trainer")
        lines = [r for r in trained(run_dir) if r["step"] <= value(tr, "specroll:trainer_step")]
        assert lines[-1]["step"] == value(tr, "specroll:trainer_step")
        assert value(tr, "specroll:reward_mean") == lines[-1]["reward_mean"]
        assert value(tr, "specroll:loss") == lines[-1]["loss"]
        assert value(tr, "specroll:trainer_samples_total") == sum(r["samples"] for r in lines)
        assert value(tr, "specroll:trainer_tokens_total") == sum(r["trained_tokens"] for r in lines)
        stale = sum(sum(r["staleness"].values()) for r in lines)
        assert value(tr, "specroll:token_staleness_count") == stale
        assert value(tr, "specroll:generators_registered") == 2
        generated = sum(value(first[g][1], "vllm:generation_tokens_total") for g in ("generator-0", "generator-1"))
        assert generated >= sum(r["trained_tokens"] for r in trained(run_dir)[:3])

        # a generator killed and restarted: its counters start again, the others' never decrease
        wait_for(lambda: value(scrape(run_dir, "generator-1")[1], "specroll:weight_syncs_total") >= 4,
                 "generator-1 to apply 4 versions", proc)
        before_kill = {actor: scrape(run_dir, actor) for actor in ROLES}
        old_target = target(run_dir, "generator-1")
        step_at_kill = value(before_kill["trainer"][1], "specroll:trainer_step")
        victim = started_pids(run_dir)["generator-1"]
        offset = (run_dir / "logs" / "generator-1.log").stat().st_size
        os.kill(victim, signal.SIGKILL)
        # welcomed again: the restart's actor is made and the trainer has counted the old one gone
        wait_for(lambda: started_pids(run_dir)["generator-1"] != victim and target(run_dir, "generator-1")
                 not in (None, old_target) and welcomed(run_dir, "generator-1", offset)
                 and answers(run_dir, "generator-1"), "generator-1's restart", proc)
        _, new = scrape(run_dir, "generator-1")
        step_now = value(scrape(run_dir, "trainer")[1], "specroll:trainer_step")
        # a fresh process applies the version it joined at and those published since: its count started again
        assert value(new, "specroll:weight_syncs_total") <= step_now - step_at_kill + 2
        assert value(new, "process_start_time_seconds") > value(before_kill["generator-1"][1],
                                                                "process_start_time_seconds")
        wait_for(lambda: value(scrape(run_dir, "trainer")[1], "specroll:trainer_step") >= step_at_kill + 2,
                 "two more steps", proc)
        for actor in ("trainer", "generator-0", "drafter-0"):
            types, old = before_kill[actor]
            _, now = scrape(run_dir, actor)
            for key, v in counters(old, types).items():
                assert now[key] >= v, (actor, key, v, now[key])
        _, tr = scrape(run_dir, "trainer")
        assert value(tr, "specroll:restarts_total", process="generator-1") >= 1
        assert value(tr, "specroll:generators_dead_total") >= 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, timeout=guard(120))
    assert code in (0, 128 + signal.SIGTERM, -signal.SIGTERM), err
    assert_nothing_left(run_dir, before)
    assert not list((run_dir / "metrics" / "targets").glob("*.json"))  # each role removed its own on exit
    # the sinks hold each trained step's record under the metrics.jsonl keys
    steps = {r["step"]: r for r in trained(run_dir)}
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    history = {h["step"]: h for h in read_wandb_run(offline).history}
    assert set(history) == set(steps) and all(history[s]["reward_mean"] == steps[s]["reward_mean"] for s in steps)
    (events,) = event_files(run_dir / "tensorboard")
    assert {s: v for (tag, s), v in scalars(events).items() if tag == "trained_tokens"} == \
        {s: r["trained_tokens"] for s, r in steps.items()}

