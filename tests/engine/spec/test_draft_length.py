"""The draft-length bandit learns the best k per batch-size bucket from tokens/s rewards."""

from __future__ import annotations

import random
import re

import pytest

from specroll.engine.spec.draft_length import DraftLengthBandit

TOKENS = 100  # tokens emitted per simulated step; the step time sets the rate


def got(value: str) -> str:
    """A ``match=`` pattern for an error message that ends by naming the bad value."""
    return re.escape(f"got {value}") + "$"


def step(bandit: DraftLengthBandit, batch_size: int, rates: list[float], noise: random.Random) -> tuple[int, float]:
    """One simulated engine step: choose k, run at rates[k] tokens/s (+-10% noise), record. Returns (k, true rate)."""
    k = bandit.choose(batch_size)
    rate = rates[k] * noise.uniform(0.9, 1.1)
    bandit.record(k, TOKENS, TOKENS / rate)
    return k, rates[k]


def test_learns_the_best_arm_per_bucket_with_small_regret():
    # tokens/s per k: at batch 1 drafting 2 is best; at batch 12 (bucket (9, 16)) plain decoding is best.
    rates = {1: [100.0, 150.0, 200.0, 170.0, 120.0], 12: [800.0, 700.0, 600.0, 500.0, 400.0]}
    best = {1: 2, 12: 0}
    bandit = DraftLengthBandit(max_k=4, epsilon=0.05, min_trials=3, seed=1)
    noise = random.Random(2)
    warmup = 5 * 3  # (K + 1) * min_trials steps per bucket
    seen = {1: 0, 12: 0}
    hits = {1: 0, 12: 0}
    earned = 0.0
    for i in range(600):
        batch_size = 1 if (i // 10) % 2 == 0 else 12  # blocks of 10 steps, interleaved
        k, rate = step(bandit, batch_size, rates[batch_size], noise)
        earned += rate
        seen[batch_size] += 1
        if seen[batch_size] > warmup:
            hits[batch_size] += k == best[batch_size]
    for b in (1, 12):
        assert hits[b] / (seen[b] - warmup) >= 0.9, (b, hits[b], seen[b])
    always_best = 300 * rates[1][2] + 300 * rates[12][0]
    assert earned >= 0.95 * always_best
    est = bandit.estimates((1, 1))
    assert max(est, key=lambda k: est[k] or 0.0) == 2
    est = bandit.estimates((9, 16))
    assert max(est, key=lambda k: est[k] or 0.0) == 0


def test_each_arm_is_tried_min_trials_times_first_longest_draft_first():
    bandit = DraftLengthBandit(max_k=3, min_trials=2, epsilon=1.0)  # epsilon=1: any bias after warm-up is random
    chosen = []
    for _ in range(4 * 2):
        k = bandit.choose(5)
        chosen.append(k)
        bandit.record(k, 10, 1.0 + k)  # k = 0 is best, but every arm must still get its trials
    assert chosen == [3, 2, 1, 0, 3, 2, 1, 0]
    assert bandit.bucket == (5, 8)
    assert bandit.estimates((5, 8)) == {0: 10.0, 1: 5.0, 2: 10 / 3, 3: 2.5}
    assert bandit.estimates((1, 1)) == {0: None, 1: None, 2: None, 3: None}
    # A fresh bucket starts its own warm-up, ordered by the estimates of the bucket just left (k = 0
    # was best there, k = 3 worst); the first bucket's estimates are kept.
    fresh = []
    for _ in range(4):
        fresh.append(bandit.choose(1))
        bandit.record(fresh[-1], 10, 1.0)
    assert fresh == [0, 1, 2, 3] and bandit.bucket == (1, 1)
    assert bandit.estimates((5, 8))[0] == 10.0


def test_hysteresis_keeps_the_bucket_across_a_wobbling_boundary():
    bandit = DraftLengthBandit(max_k=2, hysteresis=0.25)
    assert bandit.bucket is None
    for b in [8, 9] * 10:
        bandit.choose(b)
        assert bandit.bucket == (5, 8)
    bandit.choose(20)
    assert bandit.bucket == (17, 32)
    # Without hysteresis the same wobble flaps.
    flappy = DraftLengthBandit(max_k=2, hysteresis=0.0)
    seen = set()
    for b in [8, 9] * 3:
        flappy.choose(b)
        seen.add(flappy.bucket)
    assert seen == {(5, 8), (9, 16)}


def test_slow_drift_down_passes_through_buckets_without_going_back_up():
    bandit = DraftLengthBandit(max_k=2, hysteresis=0.25)
    path = []
    for b in range(16, 0, -1):
        bandit.choose(b)
        path.append(bandit.bucket)
    # (9, 16) is kept down to 8 >= 9 / 1.25 and (5, 8) down to 4 >= 5 / 1.25.
    assert path[16 - 8] == (9, 16) and path[16 - 7] == (5, 8) and path[16 - 4] == (5, 8)
    distinct = [b for i, b in enumerate(path) if i == 0 or b != path[i - 1]]
    assert distinct == [(9, 16), (5, 8), (3, 4), (2, 2), (1, 1)]


def test_sliding_window_follows_a_change_in_the_best_arm():
    window = 16
    bandit = DraftLengthBandit(max_k=3, epsilon=0.05, window=window, seed=3)
    noise = random.Random(4)
    before = [100.0, 200.0, 300.0, 250.0]  # k = 2 best
    after = [100.0, 200.0, 150.0, 400.0]  # drafting got better: k = 3 best, k = 2 worse
    for _ in range(200):
        step(bandit, 1, before, noise)
    assert max(range(4), key=lambda k: bandit.estimates((1, 1))[k] or 0.0) == 2
    # k = 2's median drops below k = 3's once half its window holds new rewards; give it one window to switch.
    for _ in range(window):
        step(bandit, 1, after, noise)
    picks = [step(bandit, 1, after, noise)[0] for _ in range(100)]
    assert picks.count(3) >= 90


def test_estimate_is_throughput_so_rare_long_acceptances_count_and_ties_go_to_the_shorter_draft():
    bandit = DraftLengthBandit(max_k=4, epsilon=0.0, min_trials=3)
    # Plain decoding: 1 token in 40 ms (25 tok/s). Drafting: usually 1 token in 45 ms, once all 5.
    steps = {0: [(1, 0.040)] * 3, 4: [(1, 0.045), (1, 0.045), (5, 0.045)], 1: [(1, 0.1)] * 3,
             2: [(1, 0.1)] * 3, 3: [(1, 0.1)] * 3}
    done = {k: 0 for k in steps}
    for _ in range(15):
        k = bandit.choose(1)
        bandit.record(k, *steps[k][done[k]])
        done[k] += 1
    assert bandit.estimates((1, 1))[4] == pytest.approx(7 / 0.135)  # a median of step rates would be 22
    assert bandit.estimates((1, 1))[0] == pytest.approx(25.0)
    assert bandit.choose(1) == 4
    tie = DraftLengthBandit(max_k=2, epsilon=0.0, min_trials=1)
    for _ in range(3):
        k = tie.choose(1)
        tie.record(k, 10, 1.0)
    assert tie.choose(1) == 0  # all at 10 tokens/s -> the smallest k


def test_epsilon_sets_the_exploration_rate_and_the_seed_makes_it_reproducible():
    def run(epsilon: float, seed: int) -> list[int]:
        bandit = DraftLengthBandit(max_k=3, epsilon=epsilon, min_trials=1, seed=seed)
        picks = []
        for _ in range(2000):
            k = bandit.choose(1)
            picks.append(k)
            bandit.record(k, 10 * (k + 1), 1.0)  # k = 3 best
        return picks[4:]

    assert set(run(0.0, 0)) == {3}
    # An exploration step with probability epsilon, drawing arm k with weight (rate_k / best)²:
    # 1/16, 4/16, 9/16, 1 for k = 0..3, so it is not the best one 14/30 of the time.
    picks = run(0.2, 0)
    explored = sum(k != 3 for k in picks) / 1996
    assert 0.2 * 14 / 30 - 0.03 <= explored <= 0.2 * 14 / 30 + 0.03
    assert picks.count(2) > 3 * picks.count(0)  # near the best rate: explored far more often
    assert run(0.2, 5) == run(0.2, 5) != run(0.2, 6)


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"max_k": 0}, "0"),
        ({"max_k": 2, "epsilon": 1.5}, "1.5"),
        ({"max_k": 2, "epsilon": -0.25}, "-0.25"),
        ({"max_k": 2, "window": 0}, "0"),
        ({"max_k": 2, "min_trials": 0}, "0"),
        ({"max_k": 2, "hysteresis": -0.5}, "-0.5"),
    ],
)
def test_bad_constructor_values_raise_naming_the_value(kwargs: dict[str, float], bad: str):
    with pytest.raises(ValueError, match=got(bad)):
        DraftLengthBandit(**kwargs)  # type: ignore[arg-type]


def test_bad_step_values_raise_naming_the_value():
    bandit = DraftLengthBandit(max_k=2)
    with pytest.raises(RuntimeError, match="before any choose"):
        bandit.record(1, 5, 0.1)
    with pytest.raises(ValueError, match=got("0")):
        bandit.choose(0)
    bandit.choose(3)
    with pytest.raises(ValueError, match=got("-1")):
        bandit.choose(-1)
    with pytest.raises(ValueError, match=got("3")):
        bandit.record(3, 5, 0.1)
    with pytest.raises(ValueError, match=got("-7")):
        bandit.record(1, -7, 0.1)
    with pytest.raises(ValueError, match=got("-0.5")):
        bandit.record(1, 5, -0.5)
    with pytest.raises(ValueError, match=got("0.0")):
        bandit.record(1, 5, 0.0)
    # A shorter k than chosen (the engine drafted fewer) is credited as passed.
    bandit.record(0, 5, 0.5)
    assert bandit.estimates((3, 4)) == {0: 10.0, 1: None, 2: None}


def test_tree_shapes_are_arms_after_the_chains():
    from specroll.engine.spec.tree import TreeShape

    small, large = TreeShape(3, 2, 6), TreeShape(5, 4, 16)
    bandit = DraftLengthBandit(max_k=2, trees=[small, large], epsilon=0.0, min_trials=1)
    assert bandit.arms == (0, 1, 2, small, large)
    tried = []
    for _ in range(5):  # warm-up: the costliest arm first
        arm = bandit.choose(1)
        tried.append(arm)
        bandit.record(arm, 6 if arm == small else 1, 0.01)  # the small tree pays most
    assert tried == [large, small, 2, 1, 0]
    assert bandit.choose(1) == small and bandit.estimates((1, 1))[small] == pytest.approx(600.0)
    with pytest.raises(ValueError, match=r"one of the trees, got tree\(depth=4"):
        bandit.record(TreeShape(4, 2, 8), 1, 0.01)
    with pytest.raises(ValueError, match="distinct TreeShapes"):
        DraftLengthBandit(max_k=2, trees=[small, small])
