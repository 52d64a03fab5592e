"""One timed engine run of the speculative benchmark: requests in, tokens/s (whole run and at full
live batch) and the engine's speculative counters out."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specroll.engine.engine import Engine
    from specroll.engine.sequence import Completion, StepOutput
    from specroll.protocol.sampling import SamplingParams

EngineFactory = Callable[..., "Engine"]
"""``(max_num_seqs, proposer=None, draft_length="fixed") -> Engine`` sharing the loaded checkpoint."""


@dataclass(frozen=True)
class Request:
    request_id: str
    group_id: str
    prompt: list[int]
    sampling: SamplingParams


@dataclass
class RunStats:
    """One timed ``run_to_completion``."""

    tokens: int
    """Response tokens emitted, EOS included."""
    seconds: float
    """Wall time from the first engine step to the last."""
    tok_s: float
    """``tokens / seconds``."""
    mean_live_batch: float
    """Sequences emitting tokens per step, averaged over the steps that emitted any."""
    acceptance_length: float
    """Tokens emitted per (sequence, step) that verified a draft; 1.0 without any."""
    num_drafted: int
    num_accepted: int
    num_draft_steps: int
    num_steps: int
    draft_time_s: float
    verify_time_s: float
    load_average: float
    """1-minute load average when the run ended: another busy process shows here."""
    steady_tok_s: float = 0.0
    """Tokens/s over the steps at a full live batch (every slot of ``max_num_seqs`` emitting): the
    rate at live batch B, free of the drain at the end, whose length differs between runs whose
    sampled responses end at different times."""
    steady_steps: int = 0
    """Steps counted in ``steady_tok_s``."""
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    repeats: int = 1
    """Runs pooled into these figures (tokens and seconds summed; the other fields are the last run's)."""
    k_steps: dict[int, int] = field(default_factory=dict)
    """Draft length k → engine steps that emitted tokens with it (off: all at k = 0)."""

    @property
    def k0_fraction(self) -> float:
        """Fraction of emitting steps that drafted nothing (k = 0)."""
        total = sum(self.k_steps.values())
        return self.k_steps.get(0, 0) / total if total else 0.0

    def as_json(self) -> dict[str, object]:
        return {**asdict(self), "k_steps": {str(k): v for k, v in sorted(self.k_steps.items())},
                "k0_fraction": self.k0_fraction}


def timed_run(engine: Engine, requests: list[Request], batch_size: int) -> tuple[dict[str, Completion], RunStats]:
    """Queue ``requests`` on a fresh ``engine`` (``max_num_seqs = batch_size``) and time
    ``run_to_completion`` over them, and each step."""
    from specroll.engine.driver import run_to_completion

    for r in requests:
        engine.add_request(r.prompt, r.sampling, r.request_id, group_id=r.group_id)
    k_steps: collections.Counter[int] = collections.Counter()
    live: list[int] = []
    steady = [0, 0.0]  # tokens, seconds over steps with a full live batch
    last = [0.0]

    def on_step(outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        if outputs:
            k_steps[engine.last_step_stats.k] += 1
            live.append(len(outputs))
            if len(outputs) == batch_size:
                steady[0] += sum(len(out.new_token_ids) for out in outputs)
                steady[1] += now - last[0]
        last[0] = now

    start = last[0] = time.perf_counter()
    done = run_to_completion(engine, on_step)
    seconds = time.perf_counter() - start
    assert len(done) == len(requests), "every queued request finishes"
    tokens = sum(len(c.token_ids) for c in done.values())
    s = engine.spec_stats
    stats = RunStats(
        tokens=tokens, seconds=seconds, tok_s=tokens / seconds, mean_live_batch=sum(live) / max(len(live), 1),
        acceptance_length=s.acceptance_length, num_drafted=s.num_drafted, num_accepted=s.num_accepted,
        num_draft_steps=s.num_draft_steps, num_steps=s.num_steps, draft_time_s=s.draft_time_s,
        verify_time_s=s.verify_time_s, load_average=os.getloadavg()[0],
        steady_tok_s=steady[0] / steady[1] if steady[1] else 0.0, steady_steps=live.count(batch_size),
        steady_tokens=int(steady[0]), steady_seconds=steady[1],
        k_steps=dict(k_steps),
    )
    return done, stats


def pool_runs(runs: list[RunStats]) -> RunStats:
    """Several runs of one mode as one: tokens and seconds summed, counters of the last run."""
    last = runs[-1]
    tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
    steady_tokens, steady_seconds = sum(r.steady_tokens for r in runs), sum(r.steady_seconds for r in runs)
    return RunStats(**{**asdict(last), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                       "steady_tokens": steady_tokens, "steady_seconds": steady_seconds,
                       "steady_tok_s": steady_tokens / steady_seconds if steady_seconds else 0.0,
                       "steady_steps": sum(r.steady_steps for r in runs), "repeats": len(runs)})
