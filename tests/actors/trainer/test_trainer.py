"""The trainer actor with real generator processes, its checkpoints and ``CausalLM.hf_weights``.

Generators run as ``python -m specroll.actors.generator`` subprocesses, each in its own process
group, always killed and reaped on the way out; the trainer runs in-process (``run_trainer``) or, to
be SIGKILLed and resumed, as ``python -m specroll.actors.trainer``. Models are tiny random-weight
checkpoints (conftest), responses at most 16 tokens, groups of 2, batches of 2 groups.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import anyio
import pytest
import torch
import zmq
import zmq.asyncio
from helpers.fake_peers import FakeGenerator, fake_generators
from helpers.processes import actor_process
from helpers.timeouts import guard
from helpers.trainer_runs import free_port, generators, metrics, overrides, run_config, wait_for

from specroll.actors.rollout.client import RolloutClient
from specroll.actors.shared.exit_codes import EXIT_PEER_LOST
from specroll.actors.trainer.checkpoint import (
    CHECKPOINT_DIRNAME,
    TrainerState,
    load_trainer_checkpoint,
    read_newest_checkpoint,
    save_checkpoint,
)
from specroll.actors.trainer.process import ENDPOINT_FILENAME, run_trainer
from specroll.engine.config import EngineConfig
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import expected_weight_shapes, load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.channel import Channel
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    FetchWeights,
    Heartbeat,
    Hello,
    RolloutChunk,
    SubmitGroup,
    ToGenerator,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import close_socket, make_socket
from specroll.protocol.weights_messages import AckWeights, WeightsAvailable

KV_GB = 0.02


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---- helpers --------------------------------------------------------------------------------


def saved_step(run_dir: Path) -> int:
    path = read_newest_checkpoint(run_dir, lambda p: p).path
    return json.loads((path / "trainer_state.json").read_text())["step"] if path else 0


def served_versions(log: Path) -> list[int]:
    return [int(v) for v in re.findall(r"serving policy version (\d+)", log.read_text())]


# ---- the pipeline ---------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.anyio
async def test_three_grpo_steps_with_two_generators(tiny_checkpoint, tmp_path: Path) -> None:
    model, run, port = tiny_checkpoint("llama"), tmp_path / "run", free_port()
    config = run_config(run, model, network__trainer_port=port)
    result: dict[str, int] = {}

    async def trainer() -> None:
        result["code"] = await run_trainer(config)

    def loaded(i: int) -> bool:
        log = tmp_path / f"gen-{i}.log"
        return log.exists() and "connecting to" in log.read_text()

    # Both generators load their model before the trainer starts: the trainer never waits for a
    # second generator, so one that was still loading could miss the whole (short) run.
    with generators(f"tcp://127.0.0.1:{port}", model, tmp_path) as procs:
        await wait_for(lambda: loaded(0) and loaded(1), guard(120), "the generators to load the model", procs)
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            await wait_for(lambda: (run / ENDPOINT_FILENAME).exists() or "code" in result, guard(60), "the endpoint")
            endpoint = (run / ENDPOINT_FILENAME).read_text()
            assert endpoint == f"tcp://127.0.0.1:{port}", endpoint
            await wait_for(lambda: "code" in result, guard(120), "the trainer to finish", procs)
            alive = [p.poll() is None for p in procs]
    assert result["code"] == 0
    assert alive == [True, True]  # the trainer's Dead leaves them waiting for a new trainer, not crashed

    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert [m["policy_version"] for m in lines] == [1, 2, 3]
    assert all(m["max_lag"] <= 1 for m in lines), [m["staleness"] for m in lines]
    assert lines[-1]["generator_versions"] == {"gen-0": 3, "gen-1": 3}
    for i in range(2):
        assert served_versions(tmp_path / f"gen-{i}.log")[-1] == 3
    assert all(m["trained_tokens"] + m["tokens_masked_stale"] > 0 for m in lines)
    assert 0.0 <= lines[-1]["reward_mean"] <= 1.0 and lines[-1]["generators_alive"] == 2
    assert (run / "config.toml").exists()

    # the checkpoint of the last step reloads into a fresh model and optimizer, and into an engine
    ckpt = load_checkpoint(model)
    policy = CausalLM(ckpt.config)
    policy.load_weights(ckpt.weights)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    state = load_trainer_checkpoint(run / CHECKPOINT_DIRNAME, policy, optimizer)
    assert (state.step, state.policy_version) == (3, 3) and state.prompt_cursor >= 3 * 2
    # random tiny models earn no reward (zero advantages); weight decay still shows the 3 AdamW steps
    assert any(not torch.equal(policy.hf_weights()[k], v) for k, v in ckpt.weights.items())
    assert [float(optimizer.state[p]["step"]) for p in policy.parameters()] == [3.0] * len(optimizer.state)
    assert len(optimizer.state) == len(list(policy.parameters()))
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=KV_GB))
    engine.update_weights(policy.hf_weights(), 3)


@pytest.mark.integration
def test_staleness_bound_holds_across_a_trainer_kill_and_resume(tiny_checkpoint, tmp_path: Path) -> None:
    anyio.run(_kill_and_resume, tiny_checkpoint("llama"), tmp_path, backend="asyncio")


STEPS = 7
LAG_TOKENS = 4
"""Tokens per sample the lagging peer stamps η + 1 versions old (and as many with its current version)."""


async def serve_lagging(gen: FakeGenerator, version: int, eta: int, groups: int, n: int) -> None:
    """A generator peer that served the killed trainer's last ``version``, takes the first ``groups``
    groups offered (room for them, then none) and answers each at once: per sample ``LAG_TOKENS``
    tokens stamped ``eta + 1`` versions below the version it serves, then as many stamped with it —
    what a generator sends for sequences it began before two weight updates. It acknowledges every
    version published, without loading it."""
    await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id=gen.actor_id))
    await gen.expect(Welcome)
    room = groups

    async def beat() -> None:
        while True:
            await gen.channel.send(Heartbeat(policy_version=version, batch_size=0, free_groups=room,
                                             free_seqs=room * n))
            await anyio.sleep(0.2)

    async with anyio.create_task_group() as tg:
        tg.start_soon(beat)
        while True:
            msg = await gen._recv.receive()
            if isinstance(msg, WeightsAvailable):
                version = msg.version
                await gen.channel.send(AckWeights(version=version))
            elif isinstance(msg, SubmitGroup):
                room -= 1
                token = msg.prompt_token_ids[-1]
                for index in range(msg.n):
                    for offset, stamp in ((0, version - eta - 1), (LAG_TOKENS, version)):
                        last = offset > 0
                        await gen.channel.send(RolloutChunk(
                            group_id=msg.group_id, sample_index=index, offset=offset, token_ids=[token] * LAG_TOKENS,
                            logprobs=[-1.0] * LAG_TOKENS, versions=[stamp] * LAG_TOKENS, finished=last,
                            finish_reason="stop" if last else None))


async def _kill_and_resume(model: Path, tmp_path: Path) -> None:
    """Incarnation 1 keeps only one batch in flight, of long responses, so it waits for generation
    after each step: it is SIGKILLed in that wait after publishing a version beyond its checkpoint
    (every 2 steps) that both generators acknowledged, so they serve a version the checkpoint lacks.

    Stale tokens are then made certain, not left to timing: the two generators are SIGSTOPped, and
    incarnation 2 (same run dir and port) starts with only a lagging peer connected
    (:func:`serve_lagging`), which takes its first batch — every sample half tokens η + 1 = 2 versions
    old, which the bound must mask, half current ones. Once that step is trained the generators go on
    (SIGCONT), rejoin under the same processes and train the rest."""
    run, port, eta = tmp_path / "run", free_port(), 1

    def command(in_flight: int, max_tokens: int) -> list[str]:
        cmd = [sys.executable, "-m", "specroll.actors.trainer"]
        for item in overrides(run, model, steps=STEPS, trainer__checkpoint_every=2, network__trainer_port=port,
                              trainer__max_groups_in_flight=in_flight, generator__sampling__max_tokens=max_tokens,
                              trainer__max_staleness=eta):
            cmd += ["--set", item]
        return cmd

    def published_beyond_checkpoint() -> bool:
        lines, saved = metrics(run), saved_step(run)
        if not (saved >= 2 and len(lines) > saved):
            return False
        version = lines[-1]["policy_version"]
        return all(served_versions(tmp_path / f"gen-{i}.log")[-1:] == [version] for i in range(2))

    with actor_process(command(2, 96), tmp_path / "trainer-1.log", append=True) as first:
        await wait_for(lambda: (run / ENDPOINT_FILENAME).exists(), guard(60), "the endpoint", [first])
        endpoint = (run / ENDPOINT_FILENAME).read_text()
        assert endpoint == f"tcp://127.0.0.1:{port}"
        with generators(endpoint, model, tmp_path) as gens:
            pids = [g.pid for g in gens]
            await wait_for(published_beyond_checkpoint, guard(120), "a version beyond the checkpoint", [first, *gens])
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=guard(30))
            before, saved = metrics(run), saved_step(run)
            served = before[-1]["policy_version"]  # what the generators serve (published_beyond_checkpoint)

            def resumed_step_trained() -> bool:
                return any(m["step"] == saved + 1 and m["trained_version"] > served for m in metrics(run))

            for g in gens:
                os.killpg(g.pid, signal.SIGSTOP)
            try:
                async with fake_generators(endpoint, "gen-lag") as (lag,), anyio.create_task_group() as tg:
                    tg.start_soon(serve_lagging, lag, served, eta, 2, 2)
                    with actor_process(command(8, 16), tmp_path / "trainer-2.log", append=True) as second:
                        await wait_for(resumed_step_trained, guard(120), "the lagging peer's batch", [second])
                        for g in gens:
                            os.killpg(g.pid, signal.SIGCONT)
                        await wait_for(lambda: second.poll() is not None, guard(120), "the resumed trainer to finish",
                                       gens)
                    tg.cancel_scope.cancel()
            finally:
                for g in gens:
                    os.killpg(g.pid, signal.SIGCONT)
            assert second.returncode == 0, (tmp_path / "trainer-2.log").read_text()[-3000:]
            assert [g.poll() for g in gens] == [None, None] and [g.pid for g in gens] == pids  # same processes

    log2 = (tmp_path / "trainer-2.log").read_text()
    resumed = re.search(r"resuming from \S+: step (\d+), policy version (\d+)", log2)
    assert resumed is not None and int(resumed[1]) == saved < len(before)
    lines = metrics(run)
    assert lines[:saved] == before[:saved]  # the lines of steps after the checkpoint were replaced
    after = lines[saved:]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    # the restored weights were published above what the generators served (the killed trainer's last)
    assert after[0]["trained_version"] == served + 1
    # the lagging peer's batch: its old half masked, every token, its current half trained
    assert after[0]["tokens_masked_stale"] == 2 * 2 * LAG_TOKENS, after[0]
    assert after[0]["staleness"] == {"0": 2 * 2 * LAG_TOKENS} and after[0]["max_lag"] == 0, after[0]
    lines = before + after  # every step the two incarnations trained, in order
    versions = [m["policy_version"] for m in lines]
    assert versions == sorted(set(versions)), versions  # versions only ever increase, across the restart
    assert all(m["max_lag"] <= eta for m in lines), [(m["step"], m["staleness"]) for m in lines]
    final = after[-1]["policy_version"]
    assert after[-1]["generator_versions"] == {"gen-0": final, "gen-1": final, "gen-lag": final}
    assert sum(m["trained_tokens"] for m in after[1:]) > 0  # the generators trained the rest
    for i in range(2):
        served_by = served_versions(tmp_path / f"gen-{i}.log")
        assert served_by == sorted(set(served_by)) and served_by[-1] == final


@pytest.mark.anyio
async def test_trainer_gives_up_without_generators(tiny_checkpoint, tmp_path: Path, caplog) -> None:
    config = run_config(tmp_path / "run", tiny_checkpoint("llama"), network__heartbeat_timeout_s=0.5)
    with anyio.fail_after(guard(60)):
        code = await run_trainer(config)
    assert code == EXIT_PEER_LOST
    assert "no generator connected" in caplog.text


@pytest.mark.anyio
async def test_client_aborts_groups_of_an_earlier_incarnation_once() -> None:
    """A restarted trainer's client meets generators still running the dead one's groups: their
    chunks get one Abort per group, never a merge; and its own group ids never repeat the old ones."""
    earlier = RolloutClient()
    old_id = await earlier.submit([1, 2, 3], 2, SamplingParams(max_tokens=4))  # never started: ids only
    ctx = zmq.asyncio.Context()
    async with RolloutClient(heartbeat_timeout_s=5.0) as client:
        sock = make_socket(ctx, zmq.DEALER, connect=client.endpoint, identity=b"gen-x")
        channel: Channel[ToGenerator] = Channel(sock, ToGenerator)
        try:
            async def receive(timeout: float) -> object:
                with anyio.fail_after(timeout):
                    return (await channel.recv()).msg

            await channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="gen-x"))
            assert isinstance(await receive(60), Welcome)
            for offset, finished in ((0, False), (2, True)):  # the old group streams on, then finishes aborted
                await channel.send(RolloutChunk(group_id=old_id, sample_index=0, offset=offset, token_ids=[5, 6],
                                                logprobs=[-1.0, -1.0], versions=[0, 0], finished=finished,
                                                finish_reason="abort" if finished else None))
            assert await receive(60) == Abort(group_id=old_id)
            new_id = await client.submit([1, 2, 3], 2, SamplingParams(max_tokens=4))
            assert int(new_id[1:]) > int(old_id[1:])
            # One Abort only (no generator capacity: nothing dispatched): the reply to a fetch of weights
            # never published comes next, through the same ordered outbox as any second Abort would have.
            await channel.send(FetchWeights(version=99))
            reply = await receive(60)
            assert isinstance(reply, Error) and "version 99 is not published" in reply.message, reply
            assert client.protocol_errors == 0 and client.coordinator.ignored_chunks == 2
            assert new_id in client.coordinator.groups and old_id not in client.coordinator.groups
        finally:
            close_socket(sock)
            ctx.term()


# ---- units ------------------------------------------------------------------------------------



@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_hf_weights_round_trip_through_load_weights_and_the_engine(tiny_checkpoint, arch: str, tied: bool) -> None:
    path = tiny_checkpoint(arch, tie_word_embeddings=tied)
    ckpt = load_checkpoint(path)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    weights = model.hf_weights()
    expected = expected_weight_shapes(ckpt.config)
    assert list(weights) == list(expected)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert all(torch.equal(weights[k], ckpt.weights[k]) for k in expected)
    with torch.no_grad():  # new weights everywhere, fused slices included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    again = CausalLM(ckpt.config)
    again.load_weights(model.hf_weights())
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True))
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_gb=KV_GB))
    engine.update_weights(model.hf_weights(), 1)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), model.parameters(), strict=True))


def test_checkpoint_round_trip_is_bit_exact(tiny_checkpoint, tmp_path: Path) -> None:
    ckpt = load_checkpoint(tiny_checkpoint("qwen2", tie_word_embeddings=False))

    def fresh() -> tuple[CausalLM, torch.optim.Optimizer]:
        model = CausalLM(ckpt.config)
        model.load_weights(ckpt.weights)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(model: CausalLM, optimizer: torch.optim.Optimizer, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, ckpt.config.vocab_size, (2, 9), generator=g)  # [B, T]
        optimizer.zero_grad()
        model.score(ids, torch.ones_like(ids, dtype=torch.bool)).logsumexp(-1).mean().backward()
        optimizer.step()

    model, optimizer = fresh()
    for seed in range(3):
        step(model, optimizer, seed)
    state = TrainerState(step=3, policy_version=5, prompt_cursor=17, seed=4, model="tiny")
    run = tmp_path / "run"
    save_checkpoint(run, model, optimizer, state)
    save_checkpoint(run, model, optimizer, state)  # over an existing one, which is kept as the previous
    assert sorted(p.name for p in run.iterdir()) == [CHECKPOINT_DIRNAME, f"{CHECKPOINT_DIRNAME}.prev"]  # no temporaries
    assert sorted(p.name for p in (run / CHECKPOINT_DIRNAME).iterdir()) == [
        "checksums.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"]

    restored, restored_opt = fresh()
    found = read_newest_checkpoint(run, lambda path: load_trainer_checkpoint(path, restored, restored_opt))
    assert (found.path, found.value, found.refused) == (run / CHECKPOINT_DIRNAME, state, [])
    for (name, a), b in zip(model.named_parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b), name
        sa, sb = optimizer.state[a], restored_opt.state[b]
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa), name
    step(model, optimizer, 9)  # and they go on identically
    step(restored, restored_opt, 9)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), restored.parameters(), strict=True))

    # a crash between the two renames of the swap leaves checkpoint.prev/ alone, which is then used
    shutil.rmtree(run / f"{CHECKPOINT_DIRNAME}.prev")
    os.rename(run / CHECKPOINT_DIRNAME, run / f"{CHECKPOINT_DIRNAME}.prev")
    assert read_newest_checkpoint(run, lambda p: p).path == run / f"{CHECKPOINT_DIRNAME}.prev"
