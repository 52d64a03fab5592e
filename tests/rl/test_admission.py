"""The feeder's admission rule (``rl/admission.py``, AReaL's staleness control), on a simulated pipeline
in its worst case for staleness: every group is sampled at once, entirely by the weights current when
it was submitted, and each step takes the oldest ``batch_groups`` finished groups."""

from __future__ import annotations

from collections import deque

import pytest

from specroll.rl.admission import Admission, run_ahead_warning


def _simulate(admission: Admission, batches: int, skipped: frozenset[int] = frozenset()) -> list[int]:
    """The lag of every group trained over ``batches`` batches (those in ``skipped`` train nothing and
    publish no version). The feeder runs when a step takes its groups and when the step finished."""
    version = 0
    finished: deque[int] = deque()  # the version that sampled each finished group, oldest first
    lags: list[int] = []

    def feed() -> None:
        while admission.room(len(finished)) > 0:
            finished.append(version)
            admission.on_submit()
        assert admission.ahead <= admission.window and len(finished) <= admission.max_groups_in_flight

    feed()
    for i in range(batches):
        assert len(finished) >= admission.batch_groups, "a step could never fill"
        batch = [finished.popleft() for _ in range(admission.batch_groups)]
        feed()
        if i not in skipped:
            lags += [version - v for v in batch]
            version += 1  # published before the feeder runs again
        admission.on_batch_done()
        feed()
    return lags


@pytest.mark.parametrize(("max_groups_in_flight", "batch_groups", "max_staleness"),
                         [(6, 2, 1), (2, 2, 1), (8, 4, 1), (16, 2, 3), (5, 5, 0), (3, 1, 0)])
def test_no_trained_group_lags_more_than_max_staleness(max_groups_in_flight: int, batch_groups: int,
                                                        max_staleness: int) -> None:
    admission = Admission(batch_groups, max_staleness, max_groups_in_flight)
    lags = _simulate(admission, 20)
    assert len(lags) == 20 * batch_groups and max(lags) <= max_staleness
    # skipped batches (no version published) never stall the feeder or loosen the bound
    admission = Admission(batch_groups, max_staleness, max_groups_in_flight)
    assert max(_simulate(admission, 20, skipped=frozenset({3, 4, 5, 11}))) <= max_staleness


def test_the_next_batch_is_generated_while_one_trains() -> None:
    # max_groups_in_flight counts groups not yet taken by a step; the staleness window counts the
    # one being trained too: with B = 2, η = 1 the next batch is submitted as a step takes its groups
    admission = Admission(batch_groups=2, max_staleness=1, max_groups_in_flight=2)
    assert admission.room(waiting=0) == 2
    admission.submitted = 2  # submitted, finished, then taken by the step being trained:
    assert admission.room(waiting=0) == 2
    admission.submitted = 4
    assert admission.room(waiting=2) == 0
    admission.on_batch_done()
    assert admission.room(waiting=0) == 2


def test_a_warning_names_a_max_groups_in_flight_the_bound_cannot_use() -> None:
    warning = run_ahead_warning(max_groups_in_flight=6, batch_groups=2, max_staleness=1)
    assert warning is not None and warning.startswith("trainer.max_groups_in_flight=6 is above")
    assert "(1 + 1) x 2 = 4" in warning and "at most 4 groups ahead" in warning
    assert run_ahead_warning(max_groups_in_flight=4, batch_groups=2, max_staleness=1) is None
    assert run_ahead_warning(max_groups_in_flight=2, batch_groups=2, max_staleness=1) is None
