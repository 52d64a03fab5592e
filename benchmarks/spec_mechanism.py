"""The mechanism measurement of ``bench_speculative.py``: greedy batch-1 decoding against a
:class:`~specroll.drafter.replay.ReplayProposer` replaying its own rollouts, so every draft is
correct and the speedup is what one-forward verification of k + 1 tokens allows; and the greedy
departures of a replay from the rollout it replayed (a near-tie rounding flip, or an error)."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from spec_timing import EngineFactory, Request, RunStats, timed_run

if TYPE_CHECKING:
    from specroll.engine.sequence import Completion

MAX_REPLAY_ROUNDS = 3
"""Replay runs at most in the mechanism measurement (see :func:`measure_mechanism`)."""
NEAR_TIE_NATS = {"float32": 0.01, "float16": 0.1, "bfloat16": 0.5}
"""Per dtype, the largest gap between two runs' chosen-token logprobs at a greedy divergence still
counted as a rounding flip between near-equal top tokens (bfloat16 logits near 32 are 0.25 apart);
anything wider is a wrong distribution: an error."""


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class Divergence:
    """Where a replay run's greedy output departed from the rollout it replayed."""

    request_id: str
    round: int
    """Replay round (1: the rollouts are speculation-off's output)."""
    position: int
    """Index of the first differing response token."""
    rollout_token: int | None
    """``None`` when the rollout ended there (the replay ran on past its EOS or max_tokens)."""
    replay_token: int | None
    """``None`` when the replay ended there (it stopped early)."""
    rollout_logprob: float | None
    """log-softmax of ``rollout_token`` in the run that produced the rollout."""
    replay_logprob: float | None
    """log-softmax of ``replay_token`` in the replay run."""
    near_tie: bool
    """The two logprobs are within the dtype's :data:`NEAR_TIE_NATS`: both runs' top tokens were about
    equally likely, a rounding flip rather than a wrong distribution."""


@dataclass
class Mechanism:
    num_prompts: int
    off: RunStats
    replay: RunStats
    """The last replay round: the timed figure."""
    rounds: int
    divergences: list[Divergence]

    @property
    def speedup(self) -> float:
        return self.replay.tok_s / self.off.tok_s

    @property
    def all_drafts_correct(self) -> bool:
        """The last round emitted exactly the rollouts it replayed."""
        return not any(d.round == self.rounds for d in self.divergences)

    @property
    def ok(self) -> bool:
        """Every draft of the timed round was correct and no round departed by more than a near-tie."""
        return self.all_drafts_correct and all(d.near_tie for d in self.divergences)

    def as_json(self) -> dict[str, object]:
        return {"num_prompts": self.num_prompts, "off": self.off.as_json(), "replay": self.replay.as_json(),
                "speedup": self.speedup, "rounds": self.rounds, "all_drafts_correct": self.all_drafts_correct,
                "matches_greedy": not self.divergences, "ok": self.ok,
                "divergences": [asdict(d) for d in self.divergences]}


def _divergences(rollouts: Mapping[str, Completion], done: Mapping[str, Completion], round_: int,
                 tolerance: float) -> list[Divergence]:
    found = []
    for rid, expected in rollouts.items():
        a, b = expected.token_ids, done[rid].token_ids
        if a != b:
            at = _first_difference(a, b)
            token_a, lp_a = (a[at], expected.logprobs[at]) if at < len(a) else (None, None)
            token_b, lp_b = (b[at], done[rid].logprobs[at]) if at < len(b) else (None, None)
            # A length difference with a common prefix is no rounding flip: both stop at EOS or max_tokens.
            near_tie = lp_a is not None and lp_b is not None and abs(lp_a - lp_b) <= tolerance
            found.append(Divergence(rid, round_, at, token_a, token_b, lp_a, lp_b, near_tie))
    return found


def measure_mechanism(make_engine: EngineFactory, prompts: list[list[int]], max_tokens: int,
                      near_tie_nats: float) -> Mechanism:
    """Greedy batch-1 decoding against replaying its rollouts, every draft correct.

    A replay step scores 1 + k tokens in one forward and a plain step 1: in reduced precision the
    logits round differently, and where the top two tokens are within rounding of each other greedy
    picks can differ. Such a sequence then leaves its rollout and drafts nothing more, so the round is
    repeated, replaying its own output, until a round emits exactly what it replays (at most
    :data:`MAX_REPLAY_ROUNDS`); the last round is the timed figure.
    """
    from specroll.drafter.replay import ReplayProposer
    from specroll.protocol.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    requests = [Request(f"m{i}", f"m{i}", prompt, greedy) for i, prompt in enumerate(prompts)]

    engine = make_engine(1)
    expected, off = timed_run(engine, requests, 1)
    del engine
    gc.collect()
    divergences: list[Divergence] = []
    for round_ in range(1, MAX_REPLAY_ROUNDS + 1):
        proposer = ReplayProposer({r.group_id: r.prompt + expected[r.request_id].token_ids for r in requests})
        engine = make_engine(1, proposer=proposer)
        done, replay = timed_run(engine, requests, 1)
        del engine
        gc.collect()
        found = _divergences(expected, done, round_, near_tie_nats)
        divergences += found
        if not found:
            break
        expected = done
    return Mechanism(len(prompts), off, replay, round_, divergences)
