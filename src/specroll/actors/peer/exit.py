"""How a peer actor (a generator, the drafter trainer) ends: its last message and its exit code
(the codes: :mod:`specroll.actors.shared.exit_codes`).

Each actor runs until a signal, a refusal or the trainer's loss, then tells the trainer why with
``Dead`` (sent with a linger, as vLLM's engine core does) so the trainer stops waiting for it
at once instead of after a heartbeat timeout, and exits with the code of the first reason given.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

import anyio

from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_OK
from specroll.protocol.channel import Channel
from specroll.protocol.messages import Dead


def failure(e: Exception) -> tuple[int, str]:
    """The exit code and reason for an internal failure ``e``."""
    return EXIT_FAILED, f"internal failure: {type(e).__name__}: {e}"


async def report_exit(channel: Channel, actor_id: str, exit: tuple[int, str] | None, linger_s: float,
                      log: logging.Logger, what: str) -> int:
    """Send ``Dead(actor_id, reason)`` (waiting at most ``linger_s`` seconds, even when cancelled), log
    the exit and return its code; ``exit`` ``None`` is a plain stop (code 0)."""
    code, reason = exit or (EXIT_OK, "stopped")
    with anyio.move_on_after(linger_s, shield=True):
        await channel.send(Dead(actor_id=actor_id, reason=reason))
    log.log(logging.INFO if code == EXIT_OK else logging.ERROR, "%s %s exits with code %d: %s", what, actor_id,
            code, reason)
    return code


class _StoppedWhileStarting(BaseException):
    """Raised by the signal handler while starting: a ``BaseException``, as ``KeyboardInterrupt`` is,
    so a loader's ``except Exception`` (the GGUF reader turns every error into a ``CheckpointError``)
    cannot swallow it and report a stop as a broken model file."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name


def _stop_in(e: BaseException) -> _StoppedWhileStarting | None:
    """The start-up stop ``e`` is, or holds (task groups wrap it in exception groups); else None."""
    if isinstance(e, _StoppedWhileStarting):
        return e
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            if (found := _stop_in(inner)) is not None:
                return found
    return None


def run_stoppable(run: Callable[[], int], log: logging.Logger, what: str, actor_id: str) -> int:
    """Run a peer's whole process, ``run()`` (load the model, connect, serve), so that a SIGTERM or
    SIGINT arriving before its connection watches signals itself — while the model loads — ends it
    with code 0, logged like every other stop, instead of killing it half-started (a launcher that
    stops a short run may signal a generator that is still loading). Returns ``run()``'s code."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise _StoppedWhileStarting(signum)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run()
    except BaseException as e:
        stop = _stop_in(e)  # the signal may land in the event loop before the role watches signals itself
        if stop is None:
            raise
        log.info("%s %s exits with code %d: received %s while starting", what, actor_id, EXIT_OK, stop.signal_name)
        return EXIT_OK
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
