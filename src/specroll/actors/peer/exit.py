"""How a peer actor (a generator, the drafter trainer) ends: its last message and its exit code
(the codes: :mod:`specroll.actors.exit_codes`).

Each actor runs until a signal, a refusal or the trainer's loss, then tells the trainer why with
``Dead`` (sent with a linger, as vLLM's engine core does) so the trainer stops waiting for it
at once instead of after a heartbeat timeout, and exits with the code of the first reason given.
"""

from __future__ import annotations

import logging

import anyio

from specroll.actors.exit_codes import EXIT_FAILED, EXIT_OK
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
