"""What a group is while the coordinator holds it: n samples of one prompt, each as streamed so far,
the lane it runs in, the generator serving it, and its failures against the retry rule
(``group_retries.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specroll.protocol.messages import SampleResume, SubmitGroup
from specroll.protocol.sampling import SamplingParams
from specroll.rl.group_retries import DroppedGroup, GroupRetries

Lane = Literal["train", "eval", "serve"]
"""What a group is for: ``train`` groups count against ``max_groups_in_flight`` and feed training;
``eval`` groups (held-out evaluation) are dispatched before any queued training group, do not count
against that bound, and finish into a queue of their own, so training never sees them; ``serve``
groups (requests of the HTTP server, ``actors/server/``) likewise, dispatched after evaluation and
before training, and never queued when finished: whoever submitted one holds it
(:attr:`RolloutCoordinator.groups` while it is live) and is told by the hub's chunk callback."""
LANES: tuple[Lane, ...] = ("eval", "serve", "train")  # dispatch order

DEFAULT_MAX_GROUP_RETRIES = 3
"""``trainer.max_group_retries``'s default: failures a group survives before it is dropped."""


@dataclass
class Sample:
    """One response of a group, as streamed so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behavior logprobs (natural log, under the processed distribution that sampled each token)."""
    versions: list[int] = field(default_factory=list)
    """The policy version of the weights that produced each token."""
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Group:
    """n samples of one prompt, in flight or finished."""

    group_id: str
    prompt_token_ids: list[int]
    samples: list[Sample]
    sampling: SamplingParams
    payload: object = None
    """Whatever the caller attached to the prompt (e.g. the reference answer for the reward)."""
    lane: Lane = "train"
    generator: str | None = None
    """Actor id serving it now; None while queued."""
    dispatches: int = 0
    """Times it was sent to a generator (1 + resumes after deaths and refusals)."""
    pin: str | None = None
    """A generator it should run on while that one is connected (an HTTP session's: prefix-cache
    reuse across turns); it waits in the queue while that generator is full, and goes anywhere once
    it is gone. None: wherever there is most room."""
    refused: str | None = None
    """Why its generator refused it (a served request's group; its samples then end as aborted)."""
    retries: GroupRetries = field(default_factory=lambda: GroupRetries(DEFAULT_MAX_GROUP_RETRIES))
    """Its failures (refused, lost) against ``max_group_retries``."""
    failed_on: set[str] = field(default_factory=set)
    """Generators it failed on: it is resumed on another while one has room."""
    draining: dict[str, set[int]] = field(default_factory=dict)
    """Generators it was taken back from (a refused chunk) → the samples each may still be running
    (until their last chunk, ``abort`` after the hub's ``Abort``, arrives). It is never sent back to
    such a generator before then: that generator's late chunks would be taken for the new run's."""
    dropped: DroppedGroup | None = None
    """Set when it was dropped (a served request's group: its submitter holds it)."""

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def submit_message(self) -> SubmitGroup:
        """The ``SubmitGroup`` for this group now: fresh, or resuming its unfinished samples."""
        resume: tuple[SampleResume, ...] = ()
        if any(s.token_ids or s.finished for s in self.samples):
            resume = tuple(
                SampleResume(index=i, token_ids=list(s.token_ids), logprobs=list(s.logprobs),
                             versions=list(s.versions))
                for i, s in enumerate(self.samples) if not s.finished
            )
        return SubmitGroup(group_id=self.group_id, prompt_token_ids=list(self.prompt_token_ids),
                           n=len(self.samples), sampling=self.sampling, resume=resume)

    def drop_record(self) -> DroppedGroup:
        """What its submitter is told when it is dropped."""
        r = self.retries
        assert r.reason is not None, "a group is dropped after a failure"
        return DroppedGroup(self.group_id, self.lane, list(self.prompt_token_ids), self.payload, r.reason,
                            r.failures, r.detail)
