"""The two RL loops ``bench_pipeline.py`` compares, run against the same generators through one
:class:`~specroll.actors.rollout.client.RolloutClient`: a synchronous loop, and specroll's off-step
loop; the synthetic long-tail workload both train (:class:`Workload`) and what each loop trained
(:class:`Phase`). "Training" is a sleep and a publish of a small dummy tensor as the next version."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fake_engine import encode_prompt

if TYPE_CHECKING:  # torch and zmq load only after the arguments parsed
    from specroll.actors.rollout.client import RolloutClient
    from specroll.rl.coordinator import Group

NEXT_FINISHED_TIMEOUT_S = 120.0
"""A step waiting longer than this for a group means something broke: fail instead of hanging."""


@dataclass(frozen=True)
class Workload:
    """Response lengths: lognormal per prompt, siblings correlated, capped (see the module docstring)."""

    n: int
    median_tokens: int
    sigma_prompt: float
    sigma_sample: float
    cap_factor: float
    seed: int

    @property
    def cap(self) -> int:
        return max(1, round(self.cap_factor * self.median_tokens))

    def lengths(self, prompt_id: int) -> list[int]:
        """Response length of each of the ``n`` samples of prompt ``prompt_id`` (deterministic)."""
        rng = random.Random(self.seed * 1_000_003 + prompt_id)
        prompt_median = self.median_tokens * math.exp(self.sigma_prompt * rng.gauss(0.0, 1.0))
        return [min(self.cap, max(1, round(prompt_median * math.exp(self.sigma_sample * rng.gauss(0.0, 1.0)))))
                for _ in range(self.n)]

    def prompt(self, prompt_id: int) -> list[int]:
        return encode_prompt(prompt_id, self.lengths(prompt_id))


@dataclass
class Phase:
    """What one loop trained, and when."""

    mode: str
    start: float = 0.0
    end: float = 0.0
    samples: int = 0
    tokens: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    """lag → trained tokens."""
    multi_version_samples: int = 0
    step_s: list[float] = field(default_factory=list)
    protocol_errors: int = 0
    """Malformed, out-of-sequence or unmergeable messages the client received (whole run; expected 0)."""

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def record(self, groups: Sequence[Group], trainer_version: int) -> None:
        for group in groups:
            for sample in group.samples:
                self.samples += 1
                self.tokens += len(sample.token_ids)
                self.staleness.update(trainer_version - v for v in sample.versions)
                self.multi_version_samples += len(set(sample.versions)) > 1


@dataclass(frozen=True)
class Settings:
    generators: int
    max_num_seqs: int
    step_s: float
    stream_every: int
    batch_groups: int
    steps: int
    train_s: float
    max_groups_in_flight: int


async def _train_and_publish(client: RolloutClient, phase: Phase, groups: list[Group], version: int,
                             train_s: float) -> int:
    """Record the batch, "train" (sleep), publish the next version; returns it."""
    import anyio
    import torch

    phase.record(groups, version)
    await anyio.sleep(train_s)
    version += 1
    await client.publish_weights({"model.norm.weight": torch.full((256,), float(version))}, version)
    return version


async def run_sync(client: RolloutClient, wl: Workload, s: Settings, version: int) -> tuple[Phase, int]:
    """The synchronous loop: every rollout of a step finishes before it trains."""
    from specroll.protocol.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=wl.cap)
    phase = Phase("sync", start=time.monotonic())
    prompt_id = 0
    for _ in range(s.steps):
        step_start = time.monotonic()
        for _ in range(s.batch_groups):
            await client.submit(wl.prompt(prompt_id), wl.n, sampling)
            prompt_id += 1
        groups = [await client.next_finished(NEXT_FINISHED_TIMEOUT_S) for _ in range(s.batch_groups)]
        version = await _train_and_publish(client, phase, groups, version, s.train_s)
        await client.wait_for_version(version, timeout=NEXT_FINISHED_TIMEOUT_S)
        phase.step_s.append(time.monotonic() - step_start)
    phase.end = time.monotonic()
    return phase, version


async def run_off_step(client: RolloutClient, wl: Workload, s: Settings, version: int) -> tuple[Phase, int]:
    """specroll's loop: train as soon as B groups finished; generation never stops for training."""
    import anyio

    from specroll.protocol.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=wl.cap)
    phase = Phase("async", start=time.monotonic())
    next_prompt = 0

    async def feed() -> None:
        nonlocal next_prompt
        while True:
            while client.num_pending + client.num_finished < s.max_groups_in_flight:
                await client.submit(wl.prompt(next_prompt), wl.n, sampling)
                next_prompt += 1
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(feed)
        for _ in range(s.steps):
            step_start = time.monotonic()
            groups = [await client.next_finished(NEXT_FINISHED_TIMEOUT_S)
                                    for _ in range(s.batch_groups)]
            version = await _train_and_publish(client, phase, groups, version, s.train_s)
            phase.step_s.append(time.monotonic() - step_start)
        phase.end = time.monotonic()
        tg.cancel_scope.cancel()
    for group_id in list(client.coordinator.groups):  # the rest of the pipeline: not trained here
        await client.abort(group_id)
    return phase, version
