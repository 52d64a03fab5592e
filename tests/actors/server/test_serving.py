"""How the server sends: its connections send without Nagle's delay."""

from __future__ import annotations

import asyncio
import socket

import pytest
from helpers.server import HANG_S

from specroll.actors.config.server_section import ServerConfig
from specroll.actors.server.serving import bind


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

