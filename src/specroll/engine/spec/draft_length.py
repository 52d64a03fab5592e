"""Each step's speculation: fixed, or adaptive by a bucketed epsilon-greedy bandit over k in {0, 1, ..., K}
and draft-tree shapes.

:class:`SpeculationPolicy` does what ``EngineConfig.draft_length`` says: ``fixed`` drafts a chain of
K every step, ``tree`` a tree of the first ``draft_trees`` shape, ``adaptive`` what
:class:`DraftLengthBandit` picks for the live decode batch; without a proposer every step decodes
plainly (k = 0).

Each engine step drafts a chain of k tokens per sequence (k = 0 is plain decoding) or a draft tree
of a given shape (``spec/tree.py``). The best arm depends on how well the drafter is doing and on
how busy the device is: at batch size 1 verification is nearly free and long drafts or wide trees
pay, at large batch sizes the step is compute-bound and drafting can cost more than it wins. So
the controller learns online, separately per live-batch-size bucket, which arm gives the most
emitted tokens per second of wall time (TLT tunes SGLang's tree parameters the same way).

Algorithm (TLT, "Taming the Long-Tail", arXiv 2511.16665; reference: mit-han-lab/fastrl, SGLang
``eagle_mab.py``, "Bucketed Epsilon-Greedy"):

- Buckets are powers of two: (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), ... With hysteresis h the
  controller stays in its bucket (lo, hi) while lo / (1 + h) <= batch_size <= hi * (1 + h), so a batch
  size wobbling across a boundary (8, 9, 8, 9) does not flap between buckets.
- Per bucket and arm k, the last ``window`` steps (tokens emitted, seconds) are kept; the estimate is
  their throughput, total tokens / total seconds, which forgets old regimes. (TLT takes the median
  of per-step rates; per-step tokens are skewed — a drafting step emits 1 token or k + 1 — and the
  median then under-rates drafting, so we estimate the rate the arm actually delivers.)
- The arms are ordered by cost: k = 0, 1, ..., K, then the tree shapes as given.
- An arm with fewer than ``min_trials`` steps in the bucket is tried first. In a fresh bucket the
  order follows the estimates of the bucket the controller just left (best first; a batch that
  drains from 16 to 1 moves through several buckets and should not start each from scratch);
  without one, the costliest arm first. After that: with probability epsilon an exploration step,
  else the arm with the best estimate (ties go to the cheaper arm: less drafting work for the
  same rate). An exploration step draws an arm with weight ``(rate / best rate)²`` (1 for an arm
  with no estimate): a step spent on an arm at half the best rate costs a whole step's time, so
  arms far behind are re-checked rarely — still now and then, since a drafter trained online gets
  better — and near-ties often. (TLT explores uniformly; measured at batch 16 with a drafter that
  does not pay there, uniform exploration of 7 arms cost 14% of the step rate.)

Errors: ``ValueError`` naming the bad value for invalid arguments; ``RuntimeError`` for ``record``
before any ``choose``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from specroll.engine.config import DraftLength
from specroll.engine.scheduler import ScheduledSequence
from specroll.engine.spec.proposer import Proposer, drafts_trees
from specroll.engine.spec.tree import TreeShape

Bucket = tuple[int, int]
Arm = int | TreeShape
"""A step's speculation: a chain of k drafts (0 = none) or a draft tree of this shape."""


def bucket_of(batch_size: int) -> Bucket:
    """The power-of-two bucket (lo, hi) containing ``batch_size``: (2^(j-1) + 1, 2^j) for batch_size > 1."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size == 1:
        return (1, 1)
    j = (batch_size - 1).bit_length()  # smallest j with 2^j >= batch_size
    return (2 ** (j - 1) + 1, 2**j)


@dataclass
class _BucketStats:
    steps: list[deque[tuple[int, float]]]
    """Per arm (index): the last ``window`` steps as (tokens emitted, seconds)."""
    trials: list[int]
    """Per arm (index): steps recorded so far (not capped by the window)."""
    warmup_order: list[int]
    """Arm indices in the order the warm-up tries them."""

    def estimate(self, i: int) -> float | None:
        """Throughput of arm i over its window, tokens/s; None before any step."""
        steps = self.steps[i]
        return sum(t for t, _ in steps) / sum(s for _, s in steps) if steps else None


class DraftLengthBandit:
    """Chooses each engine step's speculation — a draft length k in [0, ``max_k``] or one of
    ``trees`` — per live-batch bucket; see the module docstring for the algorithm."""

    def __init__(
        self,
        max_k: int,
        *,
        trees: Sequence[TreeShape] = (),
        epsilon: float = 0.05,
        window: int = 64,
        min_trials: int = 2,
        hysteresis: float = 0.25,
        seed: int = 0,
    ) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if min_trials < 1:
            raise ValueError(f"min_trials must be >= 1, got {min_trials}")
        if not hysteresis >= 0.0:
            raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")
        if len(set(trees)) != len(trees) or not all(isinstance(t, TreeShape) for t in trees):
            raise ValueError(f"trees={list(trees)}: expected distinct TreeShapes")
        self.max_k = max_k
        self.arms: tuple[Arm, ...] = (*range(max_k + 1), *trees)
        """Every arm, cheapest first."""
        self._index = {arm: i for i, arm in enumerate(self.arms)}
        self.epsilon = epsilon
        self.window = window
        self.min_trials = min_trials
        self.hysteresis = hysteresis
        self._rng = random.Random(seed)
        self._stats: dict[Bucket, _BucketStats] = {}
        self._bucket: Bucket | None = None

    @property
    def bucket(self) -> Bucket | None:
        """The current bucket (lo, hi), inclusive batch sizes; ``None`` before the first ``choose``."""
        return self._bucket

    def choose(self, batch_size: int) -> Arm:
        """The speculation (k in [0, max_k], or a tree shape) for a step whose live decoding batch
        has ``batch_size`` sequences.

        Raises ``ValueError`` if ``batch_size < 1``.
        """
        # batch_size < 1 is never within a bucket's range, so bucket_of() validates it.
        if self._bucket is None or not self._within(self._bucket, batch_size):
            left = self._bucket
            self._bucket = bucket_of(batch_size)
            self._stats_for(self._bucket, previous=left)
        stats = self._stats[self._bucket]
        untried = [i for i in stats.warmup_order if stats.trials[i] < self.min_trials]
        if untried:
            return self.arms[min(untried, key=lambda i: stats.trials[i])]  # round-robin in warm-up order
        rates = [stats.estimate(i) for i in range(len(self.arms))]
        best = max(range(len(self.arms)), key=lambda i: rates[i] or 0.0)  # max keeps the first: ties -> cheaper
        if self._rng.random() < self.epsilon:
            top = rates[best] or 0.0
            weights = [1.0 if r is None or top <= 0 else (r / top) ** 2 for r in rates]
            return self.arms[self._rng.choices(range(len(self.arms)), weights)[0]]
        return self.arms[best]

    def record(self, k: Arm, num_tokens: int, seconds: float) -> None:
        """Credit the step that ran with speculation ``k``: ``num_tokens`` emitted in ``seconds`` of wall time.

        The reward num_tokens / seconds (tokens/s) goes to the bucket the last ``choose`` used; ``k`` may differ
        from the k chosen (the engine may have drafted fewer). Raises ``ValueError`` for k outside [0, max_k]
        and not one of the trees, num_tokens < 0 or seconds <= 0, and ``RuntimeError`` if ``choose`` was never
        called.
        """
        if self._bucket is None:
            raise RuntimeError("record() called before any choose(): no bucket to credit")
        i = self._index.get(k) if isinstance(k, TreeShape) or type(k) is int else None
        if i is None:
            raise ValueError(f"k must be in [0, {self.max_k}] or one of the trees, got {k}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if not seconds > 0.0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        stats = self._stats[self._bucket]
        stats.steps[i].append((num_tokens, seconds))
        stats.trials[i] += 1

    def estimates(self, bucket: Bucket) -> dict[Arm, float | None]:
        """Throughput (tokens/s) per arm in ``bucket`` over its window; ``None`` for an arm not run there yet."""
        stats = self._stats.get(bucket)
        if stats is None:
            return dict.fromkeys(self.arms)
        return {arm: stats.estimate(i) for i, arm in enumerate(self.arms)}

    def _within(self, bucket: Bucket, batch_size: int) -> bool:
        lo, hi = bucket
        return lo / (1.0 + self.hysteresis) <= batch_size <= hi * (1.0 + self.hysteresis)

    def _stats_for(self, bucket: Bucket, previous: Bucket | None) -> _BucketStats:
        if bucket not in self._stats:
            arms = range(len(self.arms))
            order = list(reversed(arms))
            if previous is not None:
                rates = self.estimates(previous)
                order.sort(key=lambda i: -(rates[self.arms[i]] or 0.0))  # stable: unknown arms keep costliest first
            self._stats[bucket] = _BucketStats([deque(maxlen=self.window) for _ in arms], [0 for _ in arms], order)
        return self._stats[bucket]


class SpeculationPolicy:
    """Chooses each engine step's speculation (module docstring) and credits the adaptive one.

    Args:
        proposer: the engine's drafter; ``None``: plain decoding every step.
        draft_length: ``fixed``, ``tree`` or ``adaptive`` (``EngineConfig.draft_length``).
        max_k: K, the chain length of ``fixed`` and the longest chain ``adaptive`` tries.
        tree_shapes: the draft-tree shapes (``EngineConfig.tree_shapes``); used only when the
            proposer drafts trees.
        seed: the bandit's seed.

    Raises:
        ValueError: ``draft_length="tree"`` with a proposer that drafts chains only.
    """

    def __init__(
        self, proposer: Proposer | None, *, draft_length: DraftLength, max_k: int,
        tree_shapes: Sequence[TreeShape], seed: int,
    ) -> None:
        self.bandit: DraftLengthBandit | None = None
        """The adaptive controller (``adaptive`` with a proposer); ``None`` otherwise."""
        self._fixed: Arm = 0
        self._bandit_chose = False
        if proposer is None:
            return
        trees = tuple(tree_shapes) if drafts_trees(proposer) else ()
        if draft_length == "adaptive":
            self.bandit = DraftLengthBandit(max_k, trees=trees, seed=seed)
        if draft_length == "tree":
            if not trees:
                raise ValueError(f"draft_length='tree' needs a proposer that drafts trees; "
                                 f"{type(proposer).__name__} drafts chains only")
            self._fixed = trees[0]
        else:
            self._fixed = max_k

    def choose(self, num_running: int) -> Arm:
        """This step's speculation: the fixed k or tree, or the bandit's pick for ``num_running``
        live decoding sequences (the fixed k while none runs yet)."""
        self._bandit_chose = self.bandit is not None and num_running > 0
        if not self._bandit_chose:
            return self._fixed
        assert self.bandit is not None
        return self.bandit.choose(num_running)

    def record(self, arm: Arm, scheduled: Sequence[ScheduledSequence], num_emitted: int, seconds: float) -> None:
        """Credit the bandit with a step that ran ``arm`` over ``scheduled``: ``num_emitted`` tokens
        in ``seconds`` of wall time."""
        # Only pure decode steps measure a speculation (a prefill chunk's cost says nothing about
        # it), and only a step whose speculation the bandit chose (not the fixed k of a step chosen
        # while nothing ran yet, e.g. a first step whose one-token prompts are all decode-sized).
        if self.bandit is not None and self._bandit_chose and all(s.num_new_tokens == 1 for s in scheduled):
            self.bandit.record(arm, num_emitted, seconds)
