"""How far rollout generation may run ahead of training: staleness-aware admission of groups.

AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System", staleness
control; ``StalenessManager.get_capacity`` in inclusionAI/AReaL) admits a new rollout only while

    rollouts admitted so far < (v + η + 1)·B

with v the weight updates done, η the staleness bound and B the rollouts one update consumes.
Why it bounds staleness: updates consume rollouts B at a time, so the rollout admitted as number
k ≤ (v + η + 1)·B is consumed by update number ≤ v + η + 1, i.e. trained as version ≤ v + η, while
it was sampled by weights of version ≥ v (the trainer publishes version v before it admits the
groups its step made room for, and a generator applies weights and requests in the order they
arrive), so its lag is ≤ η. Rollouts finish out of order and a step takes the oldest *finished*
ones, so a long rollout can still be overtaken and lag more; its oldest tokens are then masked, the
partial rollouts' price. The count includes the batch being trained: counting only the groups not
yet taken by a step lets the feeder refill while a step trains, one batch too far ahead.

:class:`Admission` counts this trainer's groups in this run: ``submitted`` groups, and
``batches_done`` batches of B groups whose step finished — trained and published, or skipped (no
token in the loss, nothing published). Neither the step count nor the policy version would do for v:

* ``Trainer.step`` after a resume counts the steps of earlier runs while ``submitted`` starts from
  0 with the new coordinator: it would admit ``step·B`` groups beyond the bound at once;
* the policy version jumps (after a resume, or when a generator reports a higher one), again
  admitting as many batches at once, and it does not move on a skipped batch, so every skip would
  shrink the window by B until nothing could be submitted.

Beside the staleness bound, ``max_groups_in_flight`` still caps the groups queued, generating or
finished and not yet taken by a step (not the batch being trained, so ``max_groups_in_flight =
batch_groups`` means "generate the next batch while this one trains").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    """The feeder's admission rule for training groups (module docstring).

    Args:
        batch_groups: B, groups one step takes.
        max_staleness: η, most versions a trained token may lag.
        max_groups_in_flight: most groups queued, generating or finished and not yet taken by a step.
    """

    batch_groups: int
    max_staleness: int
    max_groups_in_flight: int
    submitted: int = 0
    """Training groups submitted in this run."""
    batches_done: int = 0
    """Batches of ``batch_groups`` groups whose step finished in this run (trained or skipped)."""

    @property
    def window(self) -> int:
        """(η + 1)·B: most groups submitted and not through a finished step."""
        return (self.max_staleness + 1) * self.batch_groups

    @property
    def ahead(self) -> int:
        """Groups submitted and not through a finished step: queued, generating, finished and
        waiting, or in the step being trained."""
        return self.submitted - self.batches_done * self.batch_groups

    def room(self, waiting: int) -> int:
        """Groups the feeder may submit now (≤ 0: none), given ``waiting`` groups queued, generating
        or finished and not yet taken by a step: min(max_groups_in_flight − waiting,
        (batches_done + η + 1)·B − submitted)."""
        return min(self.max_groups_in_flight - waiting, self.window - self.ahead)

    def on_submit(self) -> None:
        self.submitted += 1

    def on_drop(self) -> None:
        """A submitted group will never be trained (an episode group whose episode kept failing): it
        gives its place back, as if never submitted — it takes no place in any batch."""
        self.submitted -= 1

    def on_batch_done(self) -> None:
        """A step took its batch and finished: trained and published, or skipped."""
        self.batches_done += 1

    @property
    def max_skipped_in_row(self) -> int:
        """Most consecutive batches with no token to train (every token staler than η) once every
        generator serves the trained version: η + 1. The first such batch was at most B of the
        (η + 1)·B groups ahead; each group submitted after the generators serve the trained version
        is sampled by it (lag 0), so only the other η·B, sampled earlier, can make up more."""
        return self.max_staleness + 1


def run_ahead_warning(max_groups_in_flight: int, batch_groups: int, max_staleness: int) -> str | None:
    """A warning when ``max_groups_in_flight`` is above what the staleness bound lets the feeder use,
    (η + 1)·B (groups further ahead would train mostly on tokens staler than η, masked); else None."""
    window = (max_staleness + 1) * batch_groups
    if max_groups_in_flight <= window:
        return None
    return (f"trainer.max_groups_in_flight={max_groups_in_flight} is above (trainer.max_staleness + 1) x "
            f"trainer.batch_groups = ({max_staleness} + 1) x {batch_groups} = {window}: groups further ahead would "
            f"be trained more than max_staleness={max_staleness} versions after they were sampled, every token "
            f"masked as stale, so the trainer keeps at most {window} groups ahead of the step it trains (raise "
            f"max_staleness to run further ahead, or lower max_groups_in_flight to {window})")
