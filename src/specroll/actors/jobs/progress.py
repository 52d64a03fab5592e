"""Drive an engine to completion behind a progress bar that shows finished requests and tokens/s."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.sequence import Completion, StepOutput


@dataclass(frozen=True)
class RunResult:
    completions: dict[str, Completion]
    num_tokens: int
    """Response tokens generated during the run."""
    seconds: float
    """Wall-clock time of the run."""

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def run_with_progress(engine: Engine, total: int, desc: str | None = None, disable: bool = False) -> RunResult:
    """Step ``engine`` until its queue is empty, updating a tqdm bar of ``total`` requests."""
    num_tokens = 0
    with tqdm(total=total, unit="rollout", desc=desc, disable=disable, dynamic_ncols=True) as bar:
        start = time.perf_counter()

        def on_step(outputs: list[StepOutput]) -> None:
            nonlocal num_tokens
            num_tokens += sum(len(o.new_token_ids) for o in outputs)
            bar.update(sum(o.finished for o in outputs))
            bar.set_postfix_str(f"{num_tokens / (time.perf_counter() - start):.1f} tok/s", refresh=False)

        done = run_to_completion(engine, on_step)
        elapsed = time.perf_counter() - start
    return RunResult(done, num_tokens, elapsed)
