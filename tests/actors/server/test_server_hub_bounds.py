"""The server in front of a hub that refuses: a request past the hub's queue (``trainer.max_queued_groups``
groups waiting for a generator) is answered 429 with ``Retry-After`` and OpenAI's error body, and a
request whose group the retry rule dropped (its chunks refused past ``trainer.max_group_retries``) is
answered 503 at once. A fake generator on the hub's real socket plays the generators."""

from __future__ import annotations

import anyio
import httpx2 as httpx  # the HTTP client the openai package depends on
import pytest
from helpers.fake_peers import fake_generators
from helpers.server import HANG_S, served

from specroll.protocol.messages import Abort, Error, SubmitGroup

pytestmark = pytest.mark.anyio
REQUEST = {"prompt": [5, 6, 7], "max_tokens": 4}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_past_the_hubs_queue_a_request_is_answered_429_naming_the_capacity(tiny_llama, tmp_path):
    overrides = ("trainer.max_queued_groups=9", "trainer.max_groups_in_flight=1", "trainer.batch_groups=1",
                 "eval.every=0", "server.max_requests_in_flight=8")  # 9: the least the config allows
    async with served(tiny_llama, tmp_path, generators=0, overrides=overrides) as s, \
            fake_generators(s.client.endpoint, "full-gen") as (gen,), \
            httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S) as http:
        await gen.register(free_groups=0, free_seqs=0)  # connected, and never any room: groups stay queued
        await s.client.wait_for_generators(1, timeout=HANG_S)
        for _ in range(9):  # the hub's other holder (a trainer, an embedding stack) filled its queue
            await s.client.submit([5, 6], 1, s.config.generator.sampling)
        for stream in (False, True):
            r = await http.post("/v1/completions", json={**REQUEST, "stream": stream})
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["type"] == "RateLimitError" and error["code"] == "queue_full"
            assert "max_queued_groups = 9" in error["message"] and r.headers["retry-after"] == "1"
        assert s.state.router.rejected_total == 2 and not s.state.router.live


async def test_a_request_whose_group_is_dropped_is_answered_503_at_once(tiny_llama, tmp_path):
    async with served(tiny_llama, tmp_path, generators=0, overrides=("trainer.max_group_retries=1",)) as s, \
            fake_generators(s.client.endpoint, "bad-gen") as (gen,), \
            httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S) as http:
        await gen.register(free_groups=4, free_seqs=8)
        await s.client.wait_for_generators(1, timeout=HANG_S)

        async def refuse_every_run() -> None:
            for _ in range(2):  # its first run and its one retry: each chunk leaves a gap
                sub = await gen.expect(SubmitGroup)
                await gen.stream(sub.group_id, 0, 5, token=3, count=1)
                await gen.expect(Error)
                await gen.expect(Abort)
                await gen.stream(sub.group_id, 0, 0, token=3, count=0, reason="abort")  # it ends its sample

        for stream in (False, True):
            async with anyio.create_task_group() as tg:
                tg.start_soon(refuse_every_run)
                r = await http.post("/v1/completions", json={**REQUEST, "stream": stream})
            assert r.status_code == 503, r.text  # a stream too: its first event is the error
            error = r.json()["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == "group_dropped"
            assert "dropped after 2 failures" in error["message"] and "a gap" in error["message"]
        assert s.client.coordinator.groups_dropped == {"refused": 2} and not s.state.router.live
