"""A group that keeps failing: retried a bounded number of times, then dropped whole.

One rule for the rollout groups the coordinator dispatches (``coordinator.py``) and for the
episode groups the trainer runs (``actors/trainer/episodes.py``): every failure of one of a group's
samples counts against the group —

* ``refused``: a generator sent a chunk of it that cannot be merged (a token id outside the
  vocabulary, a gap, a disagreement with the tokens held, tokens past its ``max_tokens``), or refused
  the group itself;
* ``lost``: the generator serving it died, left, said ``Hello`` again or lost messages;
* ``failed``: an episode failed (its environment raised, timed out, took too many turns, gave no
  finite reward);

and the group is retried (resumed on another generator from the tokens already held; the episode
run again from its start) while its failures number at most ``max_group_retries``. One more and
the group is dropped whole: none of its samples is trained, ever. A partial group is never trained:
its advantages would be normalised over the samples that happened to succeed, a bias towards
whatever fails less.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DropReason = Literal["refused", "lost", "failed"]
"""Why a group failed (module docstring); a dropped group is counted under its last failure's."""
DROP_REASONS: tuple[DropReason, ...] = ("refused", "lost", "failed")

MAX_GROUP_RETRIES = 100
"""The most retries a configuration may allow a group (``trainer.max_group_retries``)."""


@dataclass
class GroupRetries:
    """One group's failures against the rule (module docstring).

    Args:
        limit: ``max_group_retries``: failures a group survives; one more drops it.

    Raises:
        ValueError: ``limit`` outside ``[0, MAX_GROUP_RETRIES]``.
    """

    limit: int
    failures: int = 0
    """Failures so far (= retries made, while the group lives)."""
    reason: DropReason | None = None
    """The last failure's reason (None: none yet)."""
    detail: str = ""
    """What the last failure said (at most 500 characters)."""

    def __post_init__(self) -> None:
        if not _is_int(self.limit) or not 0 <= self.limit <= MAX_GROUP_RETRIES:
            raise ValueError(f"max_group_retries={self.limit}, expected an integer in [0, {MAX_GROUP_RETRIES}]")

    def fail(self, reason: DropReason, detail: str) -> bool:
        """Count one failure; True while the group may be retried, False once it is to be dropped."""
        self.failures += 1
        self.reason, self.detail = reason, detail[:500]
        return self.failures <= self.limit


@dataclass(frozen=True)
class DroppedGroup:
    """A group dropped whole: what its submitter needs to submit it again or to skip it. None of its
    samples is kept (a partial group is never trained)."""

    group_id: str
    lane: str
    """The lane it was submitted in (``train``, ``eval``, ``serve``)."""
    prompt_token_ids: list[int]
    payload: object
    """What the submitter attached to it."""
    reason: DropReason
    """Its last failure's reason."""
    failures: int
    """Failures it had: ``max_group_retries + 1``."""
    detail: str
    """What its last failure said."""

    def describe(self) -> str:
        """One line naming the group, its failures and the last one's reason and detail."""
        return (f"group {self.group_id} was dropped after {self.failures} failures (more than max_group_retries = "
                f"{self.failures - 1}); the last: {self.reason}: {self.detail}")


class GroupDropped(Exception):
    """A group was dropped whole by the retry rule (module docstring): raised by
    ``RolloutClient.next_finished`` and ``wait_finished`` for a dropped group of the lane waited on.

    Attributes:
        dropped: the dropped group (its id, prompt, payload, reason); it is delivered once.
    """

    def __init__(self, dropped: DroppedGroup) -> None:
        super().__init__(dropped.describe())
        self.dropped = dropped


def _is_int(value: object) -> bool:
    """An int and not a bool (``True`` would pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
