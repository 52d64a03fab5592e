"""Bounded work from the trainer: a drafter trainer (``DrafterActor`` in this process) fed by a fake
trainer over a real socket refuses rollouts, counts and versions past their limits with an
``Error`` naming the field, the value and the limit, keeps nothing of them, and goes on running."""

from __future__ import annotations

import anyio
import pytest
import torch
import zmq
import zmq.asyncio
from helpers.fake_peers import FakeTrainer
from helpers.timeouts import guard

from specroll.actors.config import DrafterConfig, ModelSection, RunConfig
from specroll.actors.drafter_trainer.actor import DrafterActor, build_learner
from specroll.protocol.channel import Channel
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    DrafterAvailable,
    Error,
    FetchWeights,
    FinishedRollouts,
    Hello,
    RolloutTokens,
    TensorSpec,
    ToDrafter,
    WeightsAvailable,
    Welcome,
)
from specroll.protocol.sockets import close_socket, make_socket

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_drafter_trainer_refuses_oversized_rollouts_and_weights_and_keeps_running(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    config = RunConfig(run_dir=str(tmp_path / "run"), model=ModelSection(name=str(model)),
                       drafter=DrafterConfig(draft_vocab_size=64))
    threads = torch.get_num_threads()
    learner = build_learner(config)  # sets torch's threads to drafter.num_threads: restored below
    torch.set_num_threads(threads)
    context = learner.target.config.max_position_embeddings
    shapes = {n: tuple(t.shape) for n, t in learner.target.hf_weights().items()}
    peer = b"drafter-0"
    ctx = zmq.asyncio.Context()
    trainer = FakeTrainer(ctx)
    sock = make_socket(ctx, zmq.DEALER, connect=trainer.endpoint, identity=peer)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.serve)
            actor = DrafterActor(config, learner, Channel(sock, ToDrafter), connect=trainer.endpoint,
                                 actor_id=peer.decode())
            done = anyio.Event()

            async def run() -> None:
                await actor.run()
                done.set()

            tg.start_soon(run)
            assert (await trainer.expect(Hello)).role == "drafter"
            await trainer.channel.send(Welcome(protocol_version=PROTOCOL_VERSION, actor_id="trainer"), peer=peer)

            long = RolloutTokens(prompt_token_ids=[5] * context, token_ids=[6] * 10**5, policy_version=0)
            await trainer.channel.send(FinishedRollouts(rollouts=[long]), peer=peer)
            err = await trainer.expect(Error)
            assert f"= {context + 10**5}" in err.message and f"limit {context}" in err.message, err
            tiny = RolloutTokens(prompt_token_ids=[5], token_ids=[6], policy_version=0)
            await trainer.channel.send(FinishedRollouts(rollouts=[tiny] * 70_000), peer=peer)
            err = await trainer.expect(Error)
            assert "len(rollouts) = 70000" in err.message and "limit 65536" in err.message, err
            await trainer.channel.send(DrafterAvailable(version=2**64 - 1, policy_version=0, checksum=""), peer=peer)
            err = await trainer.expect(Error)  # its next version would not fit the wire
            assert f"DrafterAvailable.version = {2**64 - 1}" in err.message and f"limit {2**62}" in err.message, err
            params = [TensorSpec(name=n, shape=s) for n, s in shapes.items()]
            await trainer.channel.send(WeightsAvailable(version=1, dtype="float32", num_chunks=2**31 - 1,
                                                        params=params), peer=peer)
            err = await trainer.expect(Error)
            assert "num_chunks = 2147483647" in err.message and f"limit {len(shapes)}" in err.message, err
            await trainer.channel.send(WeightsAvailable(version=1, dtype="float32", num_chunks=1, params=params),
                                       peer=peer)
            assert (await trainer.expect(FetchWeights)).version == 1  # a sane announcement is fetched
            assert not done.is_set()
            assert learner.num_rollouts == 0 and not actor._rollouts  # nothing of the refused messages kept
            actor.stop(0, "test over")
            with anyio.fail_after(guard(30)):
                await done.wait()
            tg.cancel_scope.cancel()
    finally:
        close_socket(sock)
        close_socket(trainer.sock)
        ctx.term()
