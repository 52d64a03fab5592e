"""Stopping a role's process on SIGTERM or SIGINT: one idiom for the trainer and the server."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import anyio
import anyio.abc


def cancel_on_stop_signal(tg: anyio.abc.TaskGroup, on_signal: Callable[[signal.Signals], None]) -> None:
    """Watch for SIGTERM and SIGINT in ``tg``: on the first, call ``on_signal`` (which records the
    exit code, 128 + the signal by convention) and cancel ``tg``. Does nothing outside the main
    thread (a role run in a thread, as tests and forks do, is stopped by its caller)."""
    if threading.current_thread() is not threading.main_thread():
        return

    async def watch() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                on_signal(signal.Signals(signum))
                tg.cancel_scope.cancel()

    tg.start_soon(watch)
