"""The chaos benchmark's checks (``benchmarks/chaos_checks.py``) on hand-written run records: each
kind of failure it must catch — a lost prompt, a prompt or group trained twice, a resumed rollout
that does not continue what was streamed — is caught; a trainer restart's replaced steps are not
counted twice."""

from __future__ import annotations

import json
from pathlib import Path

from chaos_checks import check_run


def write_run(run_dir: Path, events: list[dict], cursor: int, untrained: list[int], max_lag: int = 1) -> Path:
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "checkpoint" / "trainer_state.json").write_text(json.dumps(
        {"format": 1, "step": 2, "policy_version": 2, "prompt_cursor": cursor, "seed": 0, "untrained": untrained}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "max_lag": max_lag}) + "\n")
    return run_dir


def steps(*batches: tuple[int, list[str], list[int]], resumed: dict | None = None) -> list[dict]:
    return [{"event": "step_groups", "step": s, "group_ids": g, "positions": p,
             "resumed_tokens": (resumed or {}).get(s, {})} for s, g, p in batches]


START = {"event": "trainer_start", "step": 0, "policy_version": 0}


def test_a_clean_run_passes(tmp_path: Path) -> None:
    events = [START, {"event": "group_resumed", "group_id": "g2", "actor": "generator-0", "held": {"1": [7, 8]}},
              *steps((1, ["g0", "g1"], [0, 1]), (2, ["g2", "g3"], [2, 3]), resumed={2: {"g2": [[5], [7, 8, 9]]}})]
    checks = check_run(write_run(tmp_path, events, cursor=5, untrained=[4]))
    assert checks.ok and checks.steps == 2 and checks.groups_trained == 4
    assert (checks.resumes, checks.resumes_checked, checks.max_staleness) == (1, 1, 1)


def test_each_failure_is_caught(tmp_path: Path) -> None:
    lost = check_run(write_run(tmp_path / "lost", [START, *steps((1, ["g0", "g1"], [0, 1]))], cursor=3, untrained=[]))
    assert lost.lost == [2] and not lost.ok
    batches = steps((1, ["g0", "g1"], [0, 1]), (2, ["g2", "g1"], [2, 1]))
    twice = check_run(write_run(tmp_path / "twice", [START, *batches], cursor=3, untrained=[]))
    assert twice.duplicated == [1] and twice.duplicated_groups == ["g1"] and not twice.ok
    pending = check_run(write_run(tmp_path / "pending", [START, *steps((1, ["g0"], [0]))], cursor=2, untrained=[0, 1]))
    assert pending.duplicated == [0] and not pending.ok  # trained, and still listed as untrained
    events = [START, {"event": "group_resumed", "group_id": "g0", "actor": "generator-1", "held": {"0": [4, 5, 6]}},
              *steps((1, ["g0"], [0]), resumed={1: {"g0": [[4, 5, 9, 6]]}})]
    mismatch = check_run(write_run(tmp_path / "mismatch", events, cursor=1, untrained=[]))
    assert mismatch.resume_mismatches == ["g0/0"] and not mismatch.ok


def test_steps_a_killed_trainer_ran_past_its_checkpoint_are_replaced(tmp_path: Path) -> None:
    # Incarnation 1 trained steps 1-3 and saved step 2; incarnation 2 resumed at 2 and trained step 3
    # on the positions incarnation 1 had in flight at its checkpoint (new group ids).
    events = [START, *steps((1, ["a0"], [0]), (2, ["a1"], [1]), (3, ["a2"], [2])),
              {"event": "trainer_start", "step": 2, "policy_version": 4}, *steps((3, ["b0"], [2]))]
    checks = check_run(write_run(tmp_path, events, cursor=4, untrained=[3]))
    assert checks.ok and checks.steps == 3 and checks.trainer_starts == 2


def test_a_dropped_group_whose_prompt_was_served_again_is_counted_not_lost(tmp_path: Path) -> None:
    # g1 (position 1) failed past max_group_retries: dropped; its prompt was served again as g2.
    resumes = [{"event": "group_resumed", "group_id": "g1", "actor": f"generator-{i}", "held": {}} for i in range(3)]
    dropped = {"event": "group_dropped", "group_id": "g1", "lane": "train", "reason": "lost", "failures": 4}
    events = [START, *resumes, dropped, *steps((1, ["g0", "g2"], [0, 1]))]
    checks = check_run(write_run(tmp_path / "served", events, cursor=2, untrained=[]))
    assert checks.ok and checks.dropped == {"lost": 1} and (checks.resumes, checks.most_resumes) == (3, 3)
    only_g0 = [START, dropped, *steps((1, ["g0"], [0]))]
    skipped = check_run(write_run(tmp_path / "skipped", only_g0, cursor=2, untrained=[]))
    assert skipped.lost == [1] and not skipped.ok  # dropped and never served again: lost
