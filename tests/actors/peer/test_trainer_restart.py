"""A generator across incarnations of the trainer on one endpoint: it registers again with a trainer
restarted after a kill (no ``Dead``) or after a clean end (``Dead``), leaving nothing of the old
incarnation in the way; and with no new trainer it exits 0 after a clean end, as the README promises."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio
from helpers.processes import generator_process
from helpers.timeouts import guard

from specroll.actors.rollout.client import RolloutClient
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.protocol.channel import Channel
from specroll.protocol.messages import (
    PROTOCOL_VERSION,
    FetchWeights,
    Hello,
    TensorSpec,
    ToTrainer,
    WeightsAvailable,
    Welcome,
)
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.sockets import close_socket, last_endpoint, make_socket

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_generator_registers_again_with_each_new_trainer_on_its_endpoint(tiny_checkpoint, tmp_path):
    """Three trainers in turn on one endpoint: one killed while the generator fetches its weights, one
    closed cleanly, one more. Each new one gets the generator's ``Hello``, and its ``Welcome`` is taken
    as the new trainer's (never "already welcomed"); the killed trainer's unfinished fetch does not
    block the next trainer's version; the generator sends no ``Error``; and after a clean end the
    generator's ``Hello`` comes before anything else, so the next trainer refuses nothing at all."""
    model = tiny_checkpoint("llama")
    log = tmp_path / "gen.log"
    weights = load_checkpoint(model).weights
    ctx = zmq.asyncio.Context()
    killed = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0")
    endpoint = last_endpoint(killed)
    with generator_process(endpoint, model, log) as proc:
        try:  # the first trainer: welcomes the generator, announces version 1 and dies before sending it
            channel: Channel[ToTrainer] = Channel(killed, ToTrainer)
            with anyio.fail_after(guard(60)):
                while not isinstance((await channel.recv()).msg, Hello):
                    pass
                await channel.send(Welcome(protocol_version=PROTOCOL_VERSION, actor_id="trainer"), peer=b"gen-0")
                params = [TensorSpec(name=name, shape=tuple(t.shape)) for name, t in weights.items()]
                await channel.send(WeightsAvailable(version=1, dtype="float32", params=params, num_chunks=2),
                                   peer=b"gen-0")
                while not isinstance((await channel.recv()).msg, FetchWeights):
                    pass
        finally:
            close_socket(killed)  # killed: no Dead
            ctx.term()

        async with RolloutClient(endpoint, heartbeat_timeout_s=30) as second:
            await second.wait_for_generators(1, timeout=guard(60))
            await second.publish_weights(weights, version=1, dtype="float32")
            await second.wait_for_version(1, timeout=guard(60))
            await second.submit([5, 6, 7], 2, GREEDY)
            group = await second.next_finished(timeout=guard(60))
        assert all(s.versions == [1] * 4 for s in group.samples)

        async with RolloutClient(endpoint, heartbeat_timeout_s=30) as third:  # after the second's Dead
            await third.wait_for_generators(1, timeout=guard(60))
            await third.submit([5, 6, 7], 2, GREEDY)
            group = await third.next_finished(timeout=guard(60))
        assert [len(s.token_ids) for s in group.samples] == [4, 4]
        assert third.protocol_errors == 0
        assert proc.poll() is None
    text = log.read_text()
    assert "unexpected Welcome" not in text
    assert "refused (" not in text  # every Error a generator sends is logged so
    assert text.count("welcomed by trainer") == 3


class ResumeOnceDeadIsSent(logging.Handler):
    """Continues the stopped process ``pid`` when the client logs that it sent ``Dead``."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Dead sent"):
            os.kill(self.pid, signal.SIGCONT)


async def test_a_generator_exits_0_after_a_client_that_closed_cleanly(tiny_checkpoint, tmp_path, caplog) -> None:
    """The README's promise: a generator started alone exits 0 after its trainer ended cleanly. The
    generator is stopped (SIGSTOP) while the client closes, as a busy one is slow to read: the client's
    ``Dead`` must still reach it (the client does not close before the generator read it), and nothing
    may follow it. Once with groups still dispatched and streamed, once with nothing left to send."""
    model = tiny_checkpoint("llama")
    sampling = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    caplog.set_level(logging.INFO, logger="specroll.client")
    for i, busy in enumerate((True, False)):
        log = tmp_path / f"gen-{i}.log"
        async with RolloutClient(max_groups_in_flight=16, heartbeat_timeout_s=30) as client:
            with generator_process(client.endpoint, model, log, "--max-num-seqs", "2", "--trainer-timeout-s", "1",
                                   actor_id=f"gen-{i}") as proc:
                await client.wait_for_generators(1, timeout=guard(60))
                for p in range(16 if busy else 2):  # busy: more than the generator holds at once
                    await client.submit([5 + p, 6, 7], 2, sampling)
                await client.wait_finished(2, timeout=guard(60))
                os.kill(proc.pid, signal.SIGSTOP)
                with anyio.fail_after(guard(30)):
                    while Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0] != "T":
                        await anyio.sleep(0.01)
                resume = ResumeOnceDeadIsSent(proc.pid)
                logging.getLogger("specroll.client").addHandler(resume)
                try:
                    await client.aclose()
                finally:
                    logging.getLogger("specroll.client").removeHandler(resume)
                    os.kill(proc.pid, signal.SIGCONT)
                code = await anyio.to_thread.run_sync(proc.wait, 30)
        assert code == 0, f"run {i}: {log.read_text()[-2000:]}"
        assert "the trainer ended and did not come back" in log.read_text()
