"""A bare RolloutClient (no launcher) with one peer of a kind: when that peer is killed or stopped,
the client declares it gone by the clock and the connection state alone — no other peer's message
has to arrive — and a generator's groups resume on the one started afterwards."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers.processes import drafter_process, generator_process, wait_until
from helpers.timeouts import guard

from specroll.actors.config import DrafterConfig, GeneratorConfig, ModelSection, RunConfig, write_resolved
from specroll.actors.rollout.client import RolloutClient
from specroll.protocol.messages import RolloutChunk
from specroll.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

TIMEOUT_S = 2.0
"""The client's heartbeat timeout. The peers heartbeat every 0.2 s."""
MARGIN_S = 30.0
"""How much later than the timeout a death may be declared: the client's tick, the grace after a
closed connection, and a starved machine. Without the clock-driven check it is never declared."""
HANG_S = guard(60.0)
LONG_CONTEXT = 4096
"""Positions of the model: a rollout thousands of tokens long is still running when its generator dies."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def stop(pid: int, how: signal.Signals) -> None:
    """SIGKILL: the kernel closes its connection. SIGSTOP: the connection stays open and it says nothing."""
    os.killpg(pid, how)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
async def test_a_lone_generator_that_dies_is_declared_dead_and_its_group_resumes_later(tiny_checkpoint, tmp_path,
                                                                                         how):
    model = tiny_checkpoint("llama", max_position_embeddings=LONG_CONTEXT)
    sampling = SamplingParams(temperature=1.0, max_tokens=LONG_CONTEXT - 16, ignore_eos=True, seed=1)
    chunks: list[tuple[str, RolloutChunk]] = []
    client = RolloutClient(heartbeat_timeout_s=TIMEOUT_S, on_chunk=lambda actor, c: chunks.append((actor, c)))
    async with client:
        with generator_process(client.endpoint, model, tmp_path / "gen-a.log", actor_id="gen-a") as gen_a:
            await client.wait_for_generators(1, timeout=HANG_S)
            group = await client.submit([5, 6, 7, 8], 2, sampling)
            await wait_until(lambda: any(a == "gen-a" for a, _ in chunks), HANG_S, "gen-a's first chunk")
            stop(gen_a.pid, how)
            stopped_at = time.monotonic()
            await wait_until(lambda: "gen-a" in client.dead_generators, TIMEOUT_S + MARGIN_S,
                             f"the client to declare gen-a dead after {how.name}")
            held = [list(s.token_ids) for s in client.coordinator.groups[group].samples]
            assert any(held), "gen-a streamed tokens before it died"
            assert time.monotonic() - stopped_at < TIMEOUT_S + MARGIN_S
            with generator_process(client.endpoint, model, tmp_path / "gen-b.log", actor_id="gen-b"):
                # each sample goes on at gen-b from exactly the tokens gen-a had streamed
                def resumed() -> dict[int, int]:
                    return {c.sample_index: c.offset for a, c in chunks if a == "gen-b" and c.group_id == group}

                await wait_until(lambda: len(resumed()) == 2, HANG_S, "both samples' first chunks from gen-b")
                first = {}
                for a, c in chunks:
                    if a == "gen-b" and c.group_id == group:
                        first.setdefault(c.sample_index, c.offset)
                assert first == {i: len(tokens) for i, tokens in enumerate(held)}
                assert client.coordinator.groups_of("gen-b") == [group] and client.dead_generators == ["gen-a"]


def drafter_config(model: Path, run_dir: Path) -> Path:
    drafter = DrafterConfig(enabled=True, min_rollouts=4, batch=4, window_tokens=32, draft_vocab_size=128,
                            num_threads=1)
    return write_resolved(RunConfig(run_dir=str(run_dir), model=ModelSection(name=str(model)), drafter=drafter,
                                    generator=GeneratorConfig(heartbeat_s=0.2)))


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
async def test_a_lone_drafter_trainer_that_dies_is_declared_gone_and_a_new_one_joins(tiny_checkpoint, tmp_path, how):
    model = tiny_checkpoint("llama")
    async with RolloutClient(heartbeat_timeout_s=TIMEOUT_S) as client:
        config = drafter_config(model, tmp_path / "run")
        with drafter_process(client.endpoint, config, tmp_path / "drafter-0.log") as drafter:
            await wait_until(lambda: "drafter-0" in client.drafters.drafters, HANG_S, "drafter-0's Hello")
            stop(drafter.pid, how)
            await wait_until(lambda: "drafter-0" not in client.drafters.drafters, TIMEOUT_S + MARGIN_S,
                             f"the client to declare drafter-0 gone after {how.name}")
            config = drafter_config(model, tmp_path / "run2")
            with drafter_process(client.endpoint, config, tmp_path / "drafter-1.log", actor_id="drafter-1"):
                await wait_until(lambda: "drafter-1" in client.drafters.drafters, HANG_S, "drafter-1's Hello")
                assert client.drafters.drafters == {"drafter-1"}
