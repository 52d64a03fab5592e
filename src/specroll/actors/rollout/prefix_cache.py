"""The generators' prefix caches as the hub sees them: each one's hit counters (from its last
``Stats``) and resets (``ResetPrefixCache`` → ``AckResetPrefixCache``), behind
:meth:`RolloutClient.prefix_cache_stats <specroll.actors.rollout.client.RolloutClient.prefix_cache_stats>`
and :meth:`RolloutClient.reset_prefix_cache <specroll.actors.rollout.client.RolloutClient.reset_prefix_cache>`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import anyio

from specroll.actors.rollout.outboxes import Send
from specroll.actors.shared.wakeup import Wakeup
from specroll.protocol.messages import AckResetPrefixCache, ResetPrefixCache, Stats

log = logging.getLogger("specroll.client")

RESET_TIMEOUT_S = 10.0
"""How long :meth:`PrefixCaches.reset` waits for the generators' acknowledgements by default. A
generator applies the reset between two engine steps, so it answers within a step and the time its
queued messages take to cross."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """One generator's prefix-cache counters, in tokens, cumulative since its engine started (a
    reset forgets the cache, not the counters). What counts is the engine's
    :class:`~specroll.engine.block_manager.PrefixCacheCounters`: each engine request once, when it is
    first admitted; a preemption's re-admission is not counted again."""

    prompt_tokens: int
    """Prompt tokens admitted (a resumed or re-prefilled sample's prompt holds its response so far)."""
    cached_prompt_tokens: int
    """Of those, tokens whose K/V came from the prefix cache instead of being computed."""

    @property
    def hit_rate(self) -> float:
        """``cached_prompt_tokens / prompt_tokens``, in ``[0, 1]``; 0.0 before any prompt."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Reset:
    """One reset in flight: the generators not yet heard from, and those that acknowledged."""

    waiting: set[str]
    acked: set[str] = field(default_factory=set)


class PrefixCaches:
    """The prefix caches of the hub's generators (module docstring).

    Args:
        stats: each generator's last ``Stats`` (kept by the receiver).
        generators: the generators registered now.
        send: queues a message for a peer.
    """

    def __init__(self, stats: Mapping[str, Stats], generators: Callable[[], Collection[str]], send: Send) -> None:
        self._stats, self._generators, self._send = stats, generators, send
        self._ids = itertools.count(1)
        self._resets: dict[int, _Reset] = {}
        self._changed = Wakeup()
        """An acknowledgement arrived or a generator is gone."""

    def stats(self) -> dict[str, PrefixCacheStats]:
        """Counters of every registered generator that sent ``Stats``, by actor id: as of its last
        ``Stats`` (every ``generator.stats_s``), so up to that old."""
        live = self._generators()
        return {actor: PrefixCacheStats(s.prompt_tokens, s.cached_prompt_tokens)
                for actor, s in self._stats.items() if actor in live}

    async def reset(self, timeout: float = RESET_TIMEOUT_S) -> int:
        """Ask every registered generator to forget its prefix cache and wait, ``timeout`` seconds at
        most, until each acknowledged or is gone. Returns how many acknowledged: a generator that died
        or restarted meanwhile is not waited for, nor counted; one silent past the timeout is logged
        and not counted. Each generator resets between two of its engine steps, after the messages
        it was sent before; requests it admits later share nothing cached before then."""
        request_id = next(self._ids)
        reset = _Reset(waiting=set(self._generators()))
        self._resets[request_id] = reset
        try:
            for actor in sorted(reset.waiting):
                self._send(actor, ResetPrefixCache(request_id=request_id), None)
            with anyio.move_on_after(timeout):
                while reset.waiting:
                    await self._changed.wait()
        finally:
            del self._resets[request_id]
        if reset.waiting:
            log.warning("prefix cache reset %d: no acknowledgement within %.1f s from %s", request_id, timeout,
                        ", ".join(sorted(reset.waiting)))
        return len(reset.acked)

    def on_ack(self, actor: str, msg: AckResetPrefixCache) -> None:
        """A generator forgot its prefix cache (an answer to a reset no longer waited for is dropped)."""
        reset = self._resets.get(msg.request_id)
        if reset is None or actor not in reset.waiting:
            log.debug("prefix cache reset %d acknowledged by %s, which it no longer waits for", msg.request_id, actor)
            return
        reset.waiting.discard(actor)
        reset.acked.add(actor)
        self._changed.notify()

    def gone(self, actor: str) -> None:
        """``actor`` died or restarted: no reset in flight waits for it."""
        for reset in self._resets.values():
            reset.waiting.discard(actor)
        self._changed.notify()
