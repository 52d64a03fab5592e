"""How a generator process ends, against a fake trainer: SIGTERM after an abort (a ``Dead`` and code 0),
code 3 when the trainer goes away, code 0 after a trainer that said ``Dead``, and at once when told to
stop before it was welcomed. Each process is killed and reaped on the way out, also on failure."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import anyio
import pytest
from helpers.fake_peers import HANG_S, LONG_CONTEXT, collect, fake_trainer, joined, wait_exit
from helpers.processes import generator_process

from specroll.protocol.messages import Abort, Dead, Hello, RolloutChunk, SubmitGroup
from specroll.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"

async def test_abort_mid_generation_then_sigterm(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama", max_position_embeddings=LONG_CONTEXT)
    sampling = SamplingParams(temperature=1.0, max_tokens=LONG_CONTEXT - 8, ignore_eos=True, seed=3)
    async with fake_trainer() as trainer:
        with generator_process(trainer.endpoint, model, tmp_path / "gen.log", "--stream-every", "1") as proc:
            await trainer.handshake()
            await trainer.send(SubmitGroup(group_id="g", prompt_token_ids=[1, 2, 3], n=2, sampling=sampling))
            first = await trainer.expect(RolloutChunk)
            await trainer.send(Abort(group_id="g"))
            chunks = await collect(trainer, "g", {0, 1}, prior=[first])
            for i in (0, 1):
                tokens, _ = joined(chunks[i])
                assert chunks[i][-1].finish_reason == "abort"
                assert 0 < len(tokens) < sampling.max_tokens
                assert [c.offset for c in chunks[i]] == [sum(len(c.token_ids) for c in chunks[i][:j])
                                                         for j in range(len(chunks[i]))]
            assert joined(chunks[0])[0] != joined(chunks[1])[0], "seeded siblings must differ"

            proc.send_signal(signal.SIGTERM)
            while not isinstance(msg := await trainer.next(), Dead):
                assert not isinstance(msg, RolloutChunk), msg
            assert msg.actor_id == "gen-0" and "SIGTERM" in msg.reason
            assert await wait_exit(proc) == 0


async def test_exits_nonzero_when_the_trainer_goes_away(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    log = tmp_path / "gen.log"
    with contextlib.ExitStack() as stack:
        async with fake_trainer() as trainer:
            proc = stack.enter_context(generator_process(trainer.endpoint, model, log, "--trainer-timeout-s", "1.5",
                                                         "--reconnect-timeout-s", "1.5"))
            await trainer.handshake()
            # idle but connected for longer than --trainer-timeout-s (plus a watchdog check) of the
            # generator's own running time: the trainer is alive, the generator stays
            await trainer.next_heartbeat(count=12)  # >= 11 x 0.2 s = 2.2 s > 1.5 s + 0.375 s
            assert proc.poll() is None
        assert await wait_exit(proc) == 3
    assert "no connection to and no message from the trainer" in log.read_text()


async def test_exits_zero_after_a_trainer_that_said_dead(tiny_checkpoint, tmp_path: Path) -> None:
    """A trainer that announced its exit (a finished run) and does not come back: a clean end, not an error."""
    model = tiny_checkpoint("llama")
    log = tmp_path / "gen.log"
    with contextlib.ExitStack() as stack:
        async with fake_trainer() as trainer:
            proc = stack.enter_context(generator_process(trainer.endpoint, model, log, "--trainer-timeout-s", "1.5"))
            await trainer.handshake()
            await trainer.send(Dead(actor_id="trainer", reason="finished"))
            with anyio.fail_after(HANG_S):  # it read the Dead before the connection closes (linger 0)
                while "the trainer (trainer) is exiting (finished)" not in log.read_text():
                    await anyio.sleep(0.05)
        assert await wait_exit(proc) == 0
    assert "the trainer ended and did not come back" in log.read_text()


async def test_sigterm_while_waiting_for_welcome_stops_it(tiny_checkpoint, tmp_path: Path) -> None:
    """A generator told to stop before the trainer welcomed it has no step to finish and nothing to
    flush: it ends at once instead of waiting out the handshake (longer than the launcher's grace)."""
    model = tiny_checkpoint("llama")
    log = tmp_path / "gen.log"
    with contextlib.ExitStack() as stack:
        async with fake_trainer() as trainer:
            proc = stack.enter_context(generator_process(trainer.endpoint, model, log, "--trainer-timeout-s", "600"))
            await trainer.expect(Hello)  # never answered with Welcome
            proc.send_signal(signal.SIGTERM)
            assert await wait_exit(proc) == 0, log.read_text()  # HANG_S, far below the 600 s handshake timeout
    assert "received SIGTERM" in log.read_text()
