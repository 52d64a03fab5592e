"""The launcher's live progress: the records the trainer appends to ``RUN_DIR/metrics.jsonl``,
followed across trainer restarts, and the one line each becomes on the launcher's output."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

PROGRESS_FIELDS = ("policy_version", "reward_mean", "accuracy", "eval_accuracy", "eval_step", "loss",
                   "turns_mean", "tool_calls_mean", "tool_call_errors", "sequences_mean", "groups_dropped_total",
                   "logprob_diff_mean", "logprob_kl_k3", "gen_tokens_per_s", "max_lag",
                   "tokens_masked_stale", "samples_dropped_stale", "acceptance_length", "acceptance_length_window",
                   "drafter_version", "drafter_train_s", "step_s", "wait_s", "restarts")
"""Fields of a metrics record shown in the launcher's progress line, when present (in this order)."""
ONLY_NONZERO = ("restarts", "groups_dropped_total")
"""Of those, the ones shown only when not 0."""

RERUN = "re-run"
"""The key :class:`MetricsTail` sets (true) on a record of a step trained before — a restarted
trainer trains the steps after its checkpoint again — and the mark its progress line carries."""
EVALUATED_AGAIN = "evaluated again"
"""The key it sets on a step's record written again with only new ``eval_*`` figures (a restarted
trainer evaluates its checkpoint's weights again), and that line's mark."""

WARNING_FIELDS = ("acceptance_floor_warning", "checkpoint_warning")
"""Fields of a metrics record that, when a string, are a warning the launcher prints after its line
(the trainer logs them too, but its log is not what a user watches)."""


def format_metrics(record: dict[str, object]) -> str:
    """``"step 3: reward_mean=0.25 loss=0.0132 ..."``: one progress line for a metrics record."""

    def numeric(value: object) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    keys = [k for k in PROGRESS_FIELDS if numeric(record.get(k)) and (k not in ONLY_NONZERO or record[k])]
    if not keys:
        keys = [k for k, v in record.items() if numeric(v) and k != "step"][:10]
    parts = [f"{k}={v:.4g}" if isinstance(v := record[k], float) else f"{k}={v}" for k in keys]
    skipped = " skipped (no token to train, not counted)" if record.get("skipped") is True else ""
    rerun = "".join(f" ({mark})" for mark in (RERUN, EVALUATED_AGAIN) if record.get(mark) is True)
    return f"step {record.get('step', '?')}{skipped}{rerun}: {' '.join(parts)}"

def record_warnings(record: dict[str, object]) -> list[str]:
    """The warnings a record holds (its :data:`WARNING_FIELDS` that are strings)."""
    return [text for key in WARNING_FIELDS if isinstance(text := record.get(key), str)]


class MetricsTail:
    """Reads the records appended to ``path`` since the last call, each once.

    A restarted trainer rewrites the file (a new inode: the lines of steps past its checkpoint
    dropped) and appends the re-run steps: the file is then read again from its start, and every
    line not returned before is returned — marked ``RERUN: true`` when its step is one trained before
    (returned earlier, or there before this launch), or ``EVALUATED_AGAIN: true`` when only its
    ``eval_*`` figures differ from that step's earlier record, so the progress says which are repeats.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: set[bytes] = set()
        """Lines returned (or there before this launch): never returned again."""
        self._offset = 0
        self._inode: int | None = None
        self.trained: dict[int, dict[str, object]] = {}
        """Step → its latest record (``eval_*`` left out) returned or there before this launch, skipped
        batches' records aside."""

    def skip_existing(self) -> None:
        """Never return the lines the file holds now (an earlier launch's progress)."""
        if self.path.exists():
            lines = self.path.read_bytes().splitlines()
            self.seen.update(lines)
            for line in lines:
                with contextlib.suppress(ValueError):
                    self._repeat_of(json.loads(line))

    def _repeat_of(self, record: object) -> str | None:
        """:data:`RERUN` or :data:`EVALUATED_AGAIN` when ``record`` repeats a step of :attr:`trained`
        (which it then replaces there), else None."""
        if not isinstance(record, dict) or record.get("skipped") is True:
            return None
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            return None  # step 0: the evaluation before training, not a step
        training = {k: v for k, v in record.items() if not k.startswith("eval_")}
        before, self.trained[step] = self.trained.get(step), training
        if before is None:
            return None
        return EVALUATED_AGAIN if before == training else RERUN

    def new_records(self) -> list[dict[str, object]]:
        """The complete JSON-object lines not returned before, in file order (others skipped)."""
        try:
            with self.path.open("rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self._inode:
                    self._inode, self._offset = inode, 0
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        records = []
        for line in complete.splitlines():
            if line in self.seen:
                continue  # returned already (a line the restarted trainer kept), or there before this launch
            self.seen.add(line)
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                if (mark := self._repeat_of(record)) is not None:
                    record[mark] = True
                records.append(record)
        return records
