"""The rollouts measurement of ``bench_speculative.py``: RL-style group rollouts (``n`` samples per
prompt, each with its own seed) run with speculation off, suffix drafting at fixed k and adaptive k
on identical requests, and one row of figures per temperature and live batch size."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from spec_timing import EngineFactory, Request, RunStats, pool_runs, timed_run

if TYPE_CHECKING:
    from specroll.engine.spec.proposer import Proposer

Mode = Literal["off", "suffix", "auto"]
MODES: tuple[Mode, ...] = ("off", "suffix", "auto")


def group_requests(prompts: list[list[int]], n: int, temperature: float, max_tokens: int, seed: int) -> list[Request]:
    """``n`` samples of each prompt, each with its own seed (as ``specroll generate`` seeds them)."""
    from specroll.protocol.sampling import SamplingParams

    requests = []
    for j, prompt in enumerate(prompts):
        for i in range(n):
            sampling = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens,
                                      seed=(seed * 1_000_003 + j) * 1_000_003 + i)
            requests.append(Request(f"g{j}#{i}", f"g{j}", prompt, sampling))
    return requests


@dataclass
class RolloutRow:
    temperature: float
    batch_size: int
    num_groups: int
    num_requests: int
    runs: dict[Mode, RunStats]

    def ratio(self, mode: Mode) -> float:
        """``mode``'s tokens/s at live batch B over speculation off's (the figure the targets apply to)."""
        return self.runs[mode].steady_tok_s / self.runs["off"].steady_tok_s

    def wall_ratio(self, mode: Mode) -> float:
        """``mode``'s tokens/s over the whole run, drain included, over speculation off's."""
        return self.runs[mode].tok_s / self.runs["off"].tok_s

    def as_json(self) -> dict[str, object]:
        return {"temperature": self.temperature, "batch_size": self.batch_size, "num_groups": self.num_groups,
                "num_requests": self.num_requests, **{mode: run.as_json() for mode, run in self.runs.items()},
                "suffix_ratio": self.ratio("suffix"), "auto_ratio": self.ratio("auto"),
                "suffix_wall_ratio": self.wall_ratio("suffix"), "auto_wall_ratio": self.wall_ratio("auto")}


def measure_rollouts(make_engine: EngineFactory, requests: list[Request], batch_size: int,
                     repeats: int = 1) -> dict[Mode, RunStats]:
    """The same requests with speculation off, suffix drafting at fixed k and adaptive k, ``repeats``
    times in rotating order (off, suffix, auto; suffix, auto, off; ...), so a slow spell of the
    machine does not land on one mode only; each mode's runs are pooled."""
    from specroll.drafter.suffix import SuffixProposer

    runs: dict[Mode, list[RunStats]] = {mode: [] for mode in MODES}
    for rep in range(repeats):
        for mode in MODES[rep % len(MODES):] + MODES[: rep % len(MODES)]:
            proposer: Proposer | None = None if mode == "off" else SuffixProposer()
            engine = make_engine(batch_size, proposer=proposer, draft_length="adaptive" if mode == "auto" else "fixed")
            _, r = timed_run(engine, requests, batch_size)
            runs[mode].append(r)
            del engine
            gc.collect()
            print(f"  {mode:>6}: {r.tokens} tokens in {r.seconds:.1f} s = {r.tok_s:.1f} tok/s "
                  f"({r.steady_tok_s:.1f} over {r.steady_steps} steps at live batch {batch_size}), "
                  f"acceptance length {r.acceptance_length:.2f}, mean live batch {r.mean_live_batch:.1f}, "
                  f"load {r.load_average:.1f}", flush=True)
    return {mode: pool_runs(mode_runs) for mode, mode_runs in runs.items()}
