"""What ``bench_chaos.py`` checks after a run, from the files the run leaves: every prompt position
trained exactly once (none lost, none duplicated), every resumed rollout beginning with exactly the
tokens streamed before its generator died, and the staleness bound.

The sources are the run's own records, not the launcher's word:

* ``timeline.jsonl`` — ``trainer_start`` (each trainer process: the step it starts from),
  ``step_groups`` (the groups each step consumed, with their positions in the prompt order and, for
  resumed groups, their samples' token ids as trained), ``group_resumed`` (what each resume
  carried: every token the trainer held when the generator died) and ``group_dropped`` (a group
  that failed past ``trainer.max_group_retries``: the bench's run serves its prompt again,
  ``trainer.dropped_prompts = "retry"``, so its position must still be trained once);
* ``checkpoint/trainer_state.json`` — the final prompt cursor and the positions still untrained;
* ``metrics.jsonl`` — ``max_lag`` of the trained tokens of each step (after a trainer restart the
  lines of steps past its checkpoint are replaced, so the file is the surviving lineage).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ChaosChecks:
    """The outcome of one run's checks (module docstring)."""

    steps: int = 0
    """Steps of the surviving lineage (skipped batches included)."""
    groups_trained: int = 0
    prompt_cursor: int = 0
    """Prompt positions handed out by the end."""
    untrained_at_end: int = 0
    """Positions submitted but not trained when the run ended (in flight, or finished and unused)."""
    lost: list[int] = field(default_factory=list)
    """Positions below the cursor neither trained nor pending at the end."""
    duplicated: list[int] = field(default_factory=list)
    """Positions trained more than once in the surviving lineage."""
    duplicated_groups: list[str] = field(default_factory=list)
    """Group ids trained more than once."""
    resumes: int = 0
    """Resume messages sent (a group continued on another generator)."""
    most_resumes: int = 0
    """The most resumes of one group."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Groups dropped whole by the retry rule, by their last failure's reason."""
    resumes_checked: int = 0
    """Resumed samples whose trained tokens could be compared with what the resume carried."""
    resume_mismatches: list[str] = field(default_factory=list)
    """``group/sample`` whose trained tokens do not begin with the tokens the resume carried."""
    max_staleness: int = 0
    """Largest version lag of a trained token, over the lineage's steps."""
    trainer_starts: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.duplicated_groups or self.resume_mismatches)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


def _jsonl(path: Path) -> list[dict[str, object]]:
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(record, dict):
            records.append(record)
    return records


def check_run(run_dir: Path) -> ChaosChecks:
    """Check the run in ``run_dir`` (module docstring).

    Raises:
        FileNotFoundError: the run left no timeline, metrics or final checkpoint.
    """
    out = ChaosChecks()
    events = _jsonl(run_dir / "timeline.jsonl")
    lineage: list[dict[str, object]] = []
    every_step: list[dict[str, object]] = []  # also the steps a killed trainer ran past its checkpoint
    held: list[tuple[str, int, list[int]]] = []
    resumed_by_group: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for e in events:
        kind = e.get("event")
        if kind == "trainer_start":
            out.trainer_starts += 1
            start = int(e["step"])  # type: ignore[arg-type]
            lineage = [s for s in lineage if int(s["step"]) <= start]  # type: ignore[arg-type]
        elif kind == "step_groups":
            lineage.append(e)
            every_step.append(e)
        elif kind == "group_resumed":
            out.resumes += 1
            resumed_by_group[str(e["group_id"])] += 1
            for index, ids in dict(e["held"]).items():  # type: ignore[arg-type]
                held.append((str(e["group_id"]), int(index), list(ids)))
        elif kind == "group_dropped" and e.get("lane") == "train":
            dropped[str(e.get("reason"))] += 1
    out.most_resumes = max(resumed_by_group.values(), default=0)
    out.dropped = dict(dropped)
    out.steps = len(lineage)
    positions = [int(p) for s in lineage for p in s.get("positions", [])]  # type: ignore[union-attr]
    group_ids = [str(g) for s in lineage for g in s["group_ids"]]  # type: ignore[union-attr]
    out.groups_trained = len(group_ids)
    out.duplicated = sorted(p for p, n in Counter(positions).items() if n > 1)
    out.duplicated_groups = sorted(g for g, n in Counter(group_ids).items() if n > 1)

    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    out.prompt_cursor = int(state["prompt_cursor"])
    untrained = {int(p) for p in state.get("untrained", [])}
    out.untrained_at_end = len(untrained)
    out.lost = sorted(set(range(out.prompt_cursor)) - set(positions) - untrained)
    out.duplicated += sorted(set(positions) & untrained)  # trained, yet still listed as pending

    trained: dict[str, list[list[int]]] = {}
    for s in every_step:
        for gid, samples in dict(s.get("resumed_tokens", {})).items():  # type: ignore[arg-type]
            trained[str(gid)] = samples
    for gid, index, ids in held:
        if gid in trained:
            out.resumes_checked += 1
            if trained[gid][index][: len(ids)] != ids:
                out.resume_mismatches.append(f"{gid}/{index}")

    metrics = _jsonl(run_dir / "metrics.jsonl")
    out.max_staleness = max((int(m.get("max_lag") or 0) for m in metrics if "max_lag" in m), default=0)
    return out
