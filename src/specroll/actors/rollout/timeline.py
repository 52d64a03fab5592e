"""The run's timeline: ``RUN_DIR/timeline.jsonl``, one JSON object per event, appended and flushed as
the run goes, so ``specroll report`` draws what happened (not what a log suggests) and a killed run
keeps every event before the kill.

Every line has ``t`` (wall-clock seconds since the epoch, ``time.time()``: comparable across
processes and restarts) and ``event``; the other fields depend on the event:

=====================  ===================================================================================
event                  fields
=====================  ===================================================================================
``generator_load``     ``actor``, ``live`` (samples it holds: decoding, or queued in its engine for a slot),
                       ``capacity`` (``live`` + the samples it can still take) — every heartbeat
``phase``              ``phase`` (``wait``: for finished groups; ``train``: the optimizer step; ``publish``:
                       handing the weights over; ``eval_wait``: holding a publish for an evaluation;
                       ``checkpoint``: writing one),
                       ``start``, ``end`` (wall-clock s), ``step``
``group_finished``     ``group_id``, ``lane`` (``train``, ``eval`` or ``serve``)
``step_groups``        ``step``, ``group_ids`` (the groups the step trained on, in batch order), ``prompt_ids``,
                       ``positions`` (each group's position in the prompt order), ``resumed`` (the ids of
                       groups that resumed after a generator died) and ``resumed_tokens`` (their samples'
                       token ids as trained: group id → one list per sample)
``group_resumed``      ``group_id``, ``actor`` (the generator it resumes on), ``held`` (the token ids of
                       each sample it carries: ``{index: ids}``, everything streamed before the death
                       or the refusal)
``group_dropped``      ``group_id``, ``lane``, ``reason`` (``refused`` or ``lost``: its last failure's),
                       ``failures`` (``trainer.max_group_retries`` + 1; ``rl/group_retries.py``)
``trainer_start``      ``step``, ``policy_version`` (where this trainer process starts: 0, or a checkpoint's)
``policy_published``   ``version``
``policy_served``      ``actor``, ``version`` (the generator's acknowledgement)
``drafter_published``  ``version``
``drafter_served``     ``actor``, ``version`` (a generator swapped the drafter version in)
``evaluation``         ``step``, ``policy_version``, ``accuracy``, ``prompts``
=====================  ===================================================================================
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO

from specroll.actors.shared.files import ends_a_line

TIMELINE_FILENAME = "timeline.jsonl"


class Timeline:
    """Appends events to a JSONL file, one flushed line each.

    Args:
        path: the file (``RUN_DIR/timeline.jsonl``); created with its folder if missing, appended to
            otherwise (a resumed run continues the same timeline).

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        if not ends_a_line(self.path):  # a line an earlier process was killed in (or a full disk cut) ends here
            self._file.write("\n")

    def record(self, event: str, /, **fields: object) -> None:
        """Append one event now (``t`` = ``time.time()``). Fields must be JSON-serialisable.

        Raises:
            OSError: naming the file (a full disk).
        """
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
            self._file.flush()
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
