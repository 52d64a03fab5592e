"""The trainer refuses rollout tokens outside its policy's vocabulary where they arrive, and lives.

Before the check, a generator streaming a token id equal to the vocabulary size (or a negative
one) ended the trainer in its training step (``IndexError`` from the embedding lookup, or
``OverflowError`` from the reward's decode). Here the real trainer (``run_trainer``, tiny
random-weight checkpoint, vocabulary 320) is fed by a fake generator over a real socket.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers.checkpoints import TINY_VOCAB
from helpers.fake_peers import FakeGenerator, fake_generator
from helpers.timeouts import guard
from helpers.trainer_runs import free_port, metrics, run_config, wait_for

from specroll.actors.trainer.process import ENDPOINT_FILENAME, run_trainer
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AckWeights,
    Dead,
    Error,
    Heartbeat,
    Hello,
    RolloutChunk,
    SubmitGroup,
    WeightsAvailable,
    Welcome,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def chunk(group_id: str, index: int, token_ids: list[int], finished: bool = False) -> RolloutChunk:
    """Sample ``index``'s tokens from offset 0, sampled by policy version 0."""
    n = len(token_ids)
    return RolloutChunk(group_id=group_id, sample_index=index, offset=0, token_ids=token_ids, logprobs=[-1.0] * n,
                        versions=[0] * n, finished=finished, finish_reason="length" if finished else None)


async def say_hello(gen: FakeGenerator) -> None:
    await gen.channel.send(Hello(protocol_version=PROTOCOL_VERSION, role="generator", actor_id="fake-gen"))


async def next_messages(gen: FakeGenerator, count: int) -> list[Any]:
    """The next ``count`` messages from the trainer, or fewer when it says ``Dead`` (it exited: that
    is answered with ``Hello``, as a generator does, so the trainer closes at once)."""
    messages: list[Any] = []
    while len(messages) < count:
        messages.append(await gen.expect(object))
        if isinstance(messages[-1], Dead):
            await say_hello(gen)
            break
    return messages


async def serve_until_dead(gen: FakeGenerator) -> None:
    """Acknowledge every published policy version (groups submitted are left running) until the
    trainer says ``Dead``; answer that with ``Hello``."""
    while True:
        msg: Any = await gen.expect(object, timeout=guard(120))
        if isinstance(msg, WeightsAvailable):
            await gen.channel.send(AckWeights(version=msg.version))
        elif isinstance(msg, Dead):
            await say_hello(gen)
            return


async def test_the_trainer_refuses_token_ids_outside_the_vocabulary_and_trains_on(
        tiny_checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run, port = tmp_path / "run", free_port()
    config = run_config(run, tiny_checkpoint("llama"), steps=1, trainer__batch_groups=1,
                        trainer__max_groups_in_flight=1, network__trainer_port=port)
    result: dict[str, int] = {}

    async def trainer() -> None:
        result["code"] = await run_trainer(config)

    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer)
        await wait_for(lambda: (run / ENDPOINT_FILENAME).exists() or "code" in result, guard(60), "the endpoint")
        async with fake_generator(f"tcp://127.0.0.1:{port}") as gen:
            await say_hello(gen)
            await gen.expect(Welcome)
            await gen.channel.send(Heartbeat(policy_version=0, batch_size=0, free_groups=1, free_seqs=2))
            group_id = (await gen.expect(SubmitGroup, timeout=guard(120))).group_id

            # Each bad chunk finishes its sample: were it merged, the group would go to the training step.
            # Refused, it takes the group from its generator (Abort) to run again, nothing of it held, a
            # failure under the retry rule (rl/group_retries.py; 2 of trainer.max_group_retries = 3 here).
            for index, bad, needle in ((0, [7, TINY_VOCAB], f"token_ids[1] = {TINY_VOCAB}"),
                                       (1, [-1], "token_ids[0] = -1")):
                await gen.channel.send(chunk(group_id, index, bad, finished=True))
                replies = await next_messages(gen, 2)
                if isinstance(replies[-1], Dead):
                    await wait_for(lambda: "code" in result, guard(60), "the trainer to finish")
                err, abort = replies
                assert isinstance(err, Error) and err.code == "bad_request", (result, replies, caplog.text[-2000:])
                assert needle in err.message and f"vocabulary [0, {TINY_VOCAB})" in err.message, err
                assert f"group {group_id!r} sample {index}" in err.message, err
                assert isinstance(abort, Abort) and abort.group_id == group_id, replies
                await gen.channel.send(RolloutChunk(group_id=group_id, sample_index=1 - index, offset=0, token_ids=[],
                                                    logprobs=[], versions=[], finished=True, finish_reason="abort"))
                again = await gen.expect(SubmitGroup, timeout=guard(120))  # its only generator, once it ended the rest
                assert again.group_id == group_id and again.resume == ()

            # Good tokens finish it.
            await gen.channel.send(chunk(group_id, 0, [7, 8], finished=True))
            await gen.channel.send(chunk(group_id, 1, [9], finished=True))
            await serve_until_dead(gen)
        await wait_for(lambda: "code" in result, guard(60), "the trainer to finish")

    assert result["code"] == 0, caplog.text[-3000:]
    [line] = metrics(run)
    assert line["step"] == 1 and line["samples"] == 2
    assert line["response_tokens_mean"] == 1.5  # [7, 8] and [9]: the refused tokens were never trained on
    refused = [r.getMessage() for r in caplog.records if "RolloutChunk from fake-gen refused" in r.getMessage()]
    assert len(refused) == 2 and f"= {TINY_VOCAB} is outside" in refused[0] and "= -1 is outside" in refused[1]
