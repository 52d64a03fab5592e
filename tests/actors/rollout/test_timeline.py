"""The rollout client's timeline events (``RUN_DIR/timeline.jsonl``): what a real generator's
heartbeats, finished groups and weight acknowledgements record, and the drafter relay's versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.processes import generator_process
from helpers.timeouts import guard

from specroll.actors.rollout.drafter_relay import DrafterRelay
from specroll.actors.rollout.sync_client import SyncRolloutClient
from specroll.actors.rollout.timeline import Timeline
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.protocol.messages import AckDrafter, PublishDrafter
from specroll.protocol.sampling import SamplingParams


def events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.integration
def test_the_client_records_loads_finished_groups_and_policy_versions(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    timeline = Timeline(tmp_path / "timeline.jsonl")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with SyncRolloutClient(heartbeat_timeout_s=60, timeline=timeline) as client, \
            generator_process(client.endpoint, model, tmp_path / "gen.log", "--max-num-seqs", "6", actor_id="gen-0"):
        client.wait_for_generators(1, timeout=guard(60))
        group_id = client.submit([5, 6, 7], 2, greedy)
        client.next_finished(timeout=guard(60))
        client.publish_weights(load_checkpoint(model).weights, version=2, dtype="float32")
        client.wait_for_version(2, timeout=guard(60))
    timeline.close()
    recorded = events(tmp_path / "timeline.jsonl")
    by_kind: dict[str, list[dict[str, object]]] = {}
    for e in recorded:
        assert isinstance(e.pop("t"), float)
        by_kind.setdefault(str(e.pop("event")), []).append(e)
    loads = by_kind["generator_load"]
    # capacity = max_num_seqs at every heartbeat; live at most the one group of 2
    assert loads and all(e["actor"] == "gen-0" and e["capacity"] == 6 and 0 <= e["live"] <= 2 for e in loads), loads
    assert by_kind["group_finished"] == [{"group_id": group_id, "lane": "train"}]
    assert by_kind["policy_published"] == [{"version": 2}]
    assert by_kind["policy_served"] == [{"actor": "gen-0", "version": 2}]
    assert set(by_kind) == {"generator_load", "group_finished", "policy_published", "policy_served"}


def test_the_drafter_relay_records_versions_published_and_served(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "timeline.jsonl")
    relay = DrafterRelay(lambda actor, msg, tensors: None, timeline=timeline)

    def publish(version: int) -> None:
        relay.on_publish("drafter-0", PublishDrafter(version=version, policy_version=1, config="{}", checksum="c",
                                                     tensors=(), train_steps=20 * version, train_s=3.5), {})

    publish(1)
    publish(1)  # not above the current one: refused, not recorded
    relay.on_ack("gen-0", AckDrafter(version=1, checksum="c", refused="made for another vocabulary"))
    relay.on_ack("gen-1", AckDrafter(version=1, checksum="c"))
    timeline.close()
    metrics = relay.report()
    assert (metrics["drafter_train_steps"], metrics["drafter_train_s"]) == (20, 3.5)
    assert [{k: v for k, v in e.items() if k != "t"} for e in events(tmp_path / "timeline.jsonl")] == [
        {"event": "drafter_published", "version": 1, "train_steps": 20, "train_s": 3.5},
        {"event": "drafter_served", "actor": "gen-1", "version": 1},
    ]


def test_a_line_cut_short_by_an_earlier_process_stays_on_its_own(tmp_path: Path) -> None:
    """A killed process (or a full disk) left half a line: the next event starts on a line of its own,
    so only the cut line is lost, not the next event with it."""
    path = tmp_path / "timeline.jsonl"
    path.write_text('{"t": 1.0, "event": "step_start"}\n{"t": 2.0, "ev')
    timeline = Timeline(path)
    timeline.record("trainer_start", step=3)
    timeline.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"t": 2.0, "ev' and json.loads(lines[2])["event"] == "trainer_start", lines
