"""How the server sends and follows: its connections send without Nagle's delay, and a whole reply —
whose follower wakes only when a generation finished, its choices fed chunk by chunk in the hub's
callback — says what the same request streamed says, stop strings, ``n`` and prompt batches included."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
from helpers.server import HANG_S, served

from specroll.actors.config.server_section import ServerConfig
from specroll.actors.server.serving import bind

PROMPTS = [[5, 6, 7, 8, 9], [9, 8, 7]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_connections_accepted_on_the_bound_socket_send_without_nagle() -> None:
    # asyncio sets TCP_NODELAY only where the socket's proto says TCP; without it a whole reply's body
    # waited behind its headers for the client's delayed ACK (~40 ms)
    sock = bind(ServerConfig(port=0))
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    server = await asyncio.get_running_loop().create_server(Probe, sock=sock)  # as uvicorn serves it
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, HANG_S) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def _streamed(events: list) -> dict[int, tuple[str, list[int], str | None]]:
    out: dict[int, tuple[str, list[int], str | None]] = {}
    for event in events:
        for c in event.choices:
            text, ids, finish = out.get(c.index, ("", [], None))
            out[c.index] = (text + c.text, ids + ((c.model_extra or {}).get("token_ids") or []),
                            c.finish_reason or finish)
    return out


@pytest.mark.anyio
@pytest.mark.integration
async def test_whole_replies_equal_streamed_ones_with_stop_strings_n_and_batches(tiny_llama, tmp_path) -> None:
    async with served(tiny_llama, tmp_path) as s:
        api = openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=HANG_S)
        common = {"model": s.state.model_name, "prompt": PROMPTS, "max_tokens": 24, "seed": 3, "n": 2,
                  "temperature": 1.0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
        free = await api.completions.create(**common)
        assert len(free.choices) == 4 and all(c.finish_reason == "length" for c in free.choices)
        # a stop string from the middle of choice 0's text: it ends there, the others run on (or stop too)
        text = free.choices[0].text
        stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
        whole = await api.completions.create(**common, stop=[stop])
        events = [e async for e in await api.completions.create(**common, stop=[stop], stream=True)]
        streamed = _streamed(events)
        assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == text[:text.index(stop)]
        for c in whole.choices:
            assert streamed[c.index] == (c.text, c.model_extra["token_ids"], c.finish_reason)
            before = free.choices[c.index]
            expected = before.text[:before.text.find(stop)] if stop in before.text else before.text
            assert c.text == expected
        await api.close()
