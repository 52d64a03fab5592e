"""Reproduces the libzmq abort that killed the trainer on network faults, deterministically, and
shows that the hub's socket as specroll makes it survives::

    python benchmarks/zmq_abort.py                             # the trainer's own ROUTER: survives, exit 0
    python benchmarks/zmq_abort.py --router-heartbeat-ms 1000  # with ZMTP PINGs, as before: aborted, exit 1

The abort is ``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`` in libzmq 4.3.5 (the
one every pyzmq wheel bundles; libzmq's master has the same code). Its path, in libzmq's
``stream_engine_base.cpp``:

1. a connection's input stops: the engine decoded a message its session cannot take, so it stops
   reading the socket (``_input_stopped``, ``reset_pollin``). On the trainer's ROUTER that happens
   when a peer's new connection took its route over (``ROUTER_HANDOVER``) and the old connection
   still delivers: the old pipe is being terminated and takes nothing. A stalled link does exactly
   that: the peer's ZMTP heartbeat gives up on it and reconnects, and when the link moves again its
   old connection delivers what it held (so does a trainer paused by SIGSTOP, when the backlog of
   the old connection is read after the new one's handshake);
2. the connection then hangs up or is reset (``EPOLLHUP``/``EPOLLERR`` are reported even without
   ``POLLIN``): ``in_event`` finds the input stopped, removes the descriptor and sets ``_io_error``,
   but leaves the engine and its timers in place;
3. the engine's ZMTP heartbeat timer (``HEARTBEAT_IVL`` > 0) fires and calls ``out_event``, whose
   first line is ``zmq_assert (!_io_error)``: the process aborts. A peer that closed its end cleanly
   is enough for step 2: the ROUTER's own next PING is answered with a reset.

Here the hub (a child process) serves a ROUTER; this process plays one peer: it connects as ``X``,
connects again as ``X`` (the second connection takes the route over), sends on the first and closes
it. With the ROUTER's PINGs on, the hub aborts within two heartbeat intervals; specroll's ROUTER
sends no PINGs (``protocol/sockets.py``) and survives. Exit 0 when the hub survived, 1 when it died.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import zmq

from specroll.protocol.sockets import close_socket, make_socket

LATE_MESSAGES = 20
"""Messages the old connection sends after the takeover, 10 ms apart: any one of them stops its input."""


async def serve(heartbeat_ms: int | None) -> None:
    """The hub: bind a ROUTER on a free loopback port (the trainer's own ``HubSocket``, or with
    ``heartbeat_ms`` one with ZMTP PINGs), print its endpoint, echo every message to its sender."""
    import zmq.asyncio

    from specroll.actors.rollout.hub_socket import HubSocket
    from specroll.protocol.curve import RefusalLog
    from specroll.protocol.limits import DEFAULT_MAX_FRAME_BYTES

    if heartbeat_ms is None:
        hub = HubSocket("tcp://127.0.0.1:0", window=64, hwm=1000, allow_public=False, curve=None,
                        refusals=RefusalLog(), max_frame_bytes=DEFAULT_MAX_FRAME_BYTES)
        hub.open()
        sock, endpoint = hub.socket, hub.endpoint
    else:
        sock = make_socket(zmq.asyncio.Context(), zmq.ROUTER, bind="tcp://127.0.0.1:0", heartbeat_ivl_ms=heartbeat_ms)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    assert sock is not None
    print(endpoint, flush=True)
    while True:
        peer, body = await sock.recv_multipart()
        try:
            await sock.send_multipart([peer, body], flags=zmq.DONTWAIT)
        except zmq.ZMQError:
            pass  # the peer is gone or slow: the echo is only a receipt


def echo(sock: zmq.Socket, body: bytes, timeout_s: float) -> bool:  # type: ignore[type-arg]
    """Send ``body`` and wait up to ``timeout_s`` for the hub's echo of it."""
    sock.send(body)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)) and sock.recv() == body:
            return True
    return False


def provoke(endpoint: str, timeout_s: float) -> None:
    """The peer's side: the route taken over, the old connection delivering late, then closed.

    Raises:
        RuntimeError: the hub did not answer within ``timeout_s`` before the fault (not the abort).
    """
    ctx = zmq.Context()
    old = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=b"X")
    new = None
    try:
        if not echo(old, b"first connection", timeout_s):
            raise RuntimeError(f"the hub at {endpoint} did not answer within {timeout_s} s")
        new = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=b"X")
        if not echo(new, b"second connection", timeout_s):  # answered on it: the route is taken over
            raise RuntimeError(f"the hub at {endpoint} did not answer the second connection within {timeout_s} s")
        for _ in range(LATE_MESSAGES):
            old.send(b"late, on the old connection")
            time.sleep(0.01)
    finally:
        close_socket(old)  # a FIN; the hub's next PING on it draws a reset
        if new is not None:
            close_socket(new)
        ctx.term()


def answers(endpoint: str, timeout_s: float) -> bool:
    """Whether the hub echoes a message on a fresh connection within ``timeout_s``."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=b"Y")
    try:
        return echo(sock, b"after the fault", timeout_s)
    finally:
        close_socket(sock)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router-heartbeat-ms", type=int, help="ZMTP PING interval of the hub's ROUTER "
                   "(default: the trainer's own socket, which sends none)")
    p.add_argument("--watch-s", type=float, default=5.0, help="seconds to watch the hub after the fault (default 5)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the hub's process
    a = p.parse_args(argv)
    if a.router_heartbeat_ms is not None and a.router_heartbeat_ms < 0:
        p.error(f"--router-heartbeat-ms {a.router_heartbeat_ms}: expected milliseconds >= 0")
    if a.serve:
        asyncio.run(serve(a.router_heartbeat_ms))
        return 0
    cmd = [sys.executable, __file__, "--serve"]
    if a.router_heartbeat_ms is not None:
        cmd += ["--router-heartbeat-ms", str(a.router_heartbeat_ms)]
    hub = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hub.stdout is not None
        endpoint = hub.stdout.readline().strip()
        if not endpoint:
            print(f"zmq_abort: the hub did not start: {hub.communicate()[1][-2000:]}")
            return 1
        provoke(endpoint, timeout_s=60)
        try:
            code = hub.wait(timeout=a.watch_s)
        except subprocess.TimeoutExpired:
            if not answers(endpoint, timeout_s=60):
                print(f"zmq_abort: the hub is alive but no longer answers ({a.watch_s:g} s after the fault)")
                return 1
            print(f"zmq_abort: the hub survived the fault and still answers ({a.watch_s:g} s watched)")
            return 0
        err = hub.communicate()[1].strip().splitlines()
        print(f"zmq_abort: the hub died with exit {code} ({err[-1] if err else 'no output'})")
        return 1
    finally:
        if hub.poll() is None:
            hub.kill()
            hub.wait()


if __name__ == "__main__":
    sys.exit(main())
