"""The drafter relay (``actors/rollout/drafter_relay.py``), without sockets: what it refuses, how it
answers a fetch overtaken by a newer version, and the acceptance it reports per drafter version."""

from __future__ import annotations

from typing import Any

import torch

from specroll.actors.rollout.drafter_relay import DrafterRelay
from specroll.protocol.codec import pack_tensors
from specroll.protocol.messages import (
    DrafterAvailable,
    DrafterWeights,
    Error,
    FetchDrafter,
    PublishDrafter,
    RolloutChunk,
    SpecStats,
)


def test_the_relay_refuses_drafter_versions_past_the_protocol_limits() -> None:
    sent: list[tuple[str, Any]] = []
    relay = DrafterRelay(lambda actor, msg, tensors: sent.append((actor, msg)))
    relay.add_drafter("drafter-0")
    for count, version, needle in ((300, 1, "PublishDrafter.len(tensors) = 300"),
                                   (1, 2**64 - 1, f"PublishDrafter.version = {2**64 - 1}")):
        refs, frames = pack_tensors((f"t{i}", torch.zeros(1)) for i in range(count))
        msg = PublishDrafter(version=version, policy_version=0, config="{}", checksum="c", tensors=refs)
        relay.on_publish("drafter-0", msg, dict(zip((r.name for r in refs), frames, strict=True)))
        assert relay.published is None
        [(actor, err)] = sent
        assert actor == "drafter-0" and isinstance(err, Error) and needle in err.message, err
        sent.clear()


def test_a_fetch_overtaken_by_a_newer_drafter_version_is_answered_with_its_announcement_not_an_error():
    """A drafter trainer publishing faster than a fetch's round trip: the generator's fetch of version 2
    arrives after version 3 was published. Nothing is lost (version 3 is announced, and the generator
    fetches it), so it is no error; a version never published still is one."""
    sent: list[tuple[str, object]] = []
    relay = DrafterRelay(lambda actor, msg, tensors: sent.append((actor, msg)))
    for version in (2, 3):
        relay.on_publish("drafter-0", PublishDrafter(version=version, policy_version=1, config="{}", checksum="c",
                                                     tensors=()), {})
    sent.clear()
    relay.on_fetch("gen-0", FetchDrafter(version=2))
    assert [type(m) for _, m in sent] == [DrafterAvailable] and sent[0][1].version == 3
    sent.clear()
    relay.on_fetch("gen-0", FetchDrafter(version=3))
    assert [type(m) for _, m in sent] == [DrafterWeights] and sent[0][1].version == 3
    sent.clear()
    relay.on_fetch("gen-0", FetchDrafter(version=9))
    assert [type(m) for _, m in sent] == [Error, DrafterAvailable]
    assert "version 9 is not published" in sent[0][1].message


def test_acceptance_is_reported_per_version_and_a_drop_below_the_floor_warns(caplog):
    relay = DrafterRelay(lambda actor, msg, tensors: None)

    def chunk(drafter: int, policy: int, accepted: int, steps: int) -> RolloutChunk:
        return RolloutChunk(group_id="g", sample_index=0, offset=0, token_ids=[1], logprobs=[0.0], versions=[policy],
                            spec=SpecStats(num_drafted=4 * steps, num_accepted=accepted, num_draft_steps=steps,
                                           drafter_version=drafter))

    relay.on_chunk(chunk(3, 7, 30, 10))
    relay.on_chunk(chunk(3, 8, 5, 10))
    with caplog.at_level("WARNING"):
        report = relay.report(floor=1.8)
    assert report["acceptance_by_version"] == [
        {"drafter_version": 3, "policy_version": 7, "acceptance_length": 4.0, "draft_steps": 10},
        {"drafter_version": 3, "policy_version": 8, "acceptance_length": 1.5, "draft_steps": 10},
    ]
    assert report["acceptance_length_window"] == 1 + 35 / 20
    assert report["acceptance_below_floor"] is True  # the newest policy version (8) is at 1.5 < 1.8
    assert "below the floor 1.80" in caplog.text
    warning = report["acceptance_floor_warning"]  # in the metrics line too: the launcher prints it
    assert "acceptance length 1.50 under policy version 8 is below the floor 1.80" in warning, warning
    relay.on_chunk(chunk(4, 8, 25, 10))
    report = relay.report(floor=1.8)  # only what arrived since the last report
    assert report["acceptance_by_version"] == [
        {"drafter_version": 4, "policy_version": 8, "acceptance_length": 3.5, "draft_steps": 10}]
    assert report["acceptance_below_floor"] is False and report["acceptance_floor_warning"] is None
