"""Served requests over the rollout hub: each HTTP request is one group of ``n`` samples in the
``serve`` lane (:data:`specroll.rl.coordinator.Lane`), so everything a rollout has holds for it —
partial output streamed as the generator makes it, resume on another generator from the tokens
held after a generator death, per-token policy versions, lossless speculation, CURVE.

The :class:`Router` follows its groups through the hub's chunk callback (the held
:class:`~specroll.rl.coordinator.Group` has every sample's merged tokens; a :class:`Generation` turns
them into choices' text, :mod:`choice_text`), ends a group early when every choice hit a stop
string, aborts it when its client goes away, and bounds the work: at most
``server.max_requests_in_flight`` requests at once (then 429), none past the hub's queue
(``trainer.max_queued_groups`` groups waiting for a generator: 429), none without a generator (503),
none waiting longer than ``server.request_timeout_s`` (504). A request whose group kept failing on the
generators — refused or lost more than ``trainer.max_group_retries`` times — is dropped by the hub
and answered 503 (``specroll/rl/group_retries.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import anyio

from specroll.actors.config.server_section import ServerConfig
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.server.choice_text import ChoiceText
from specroll.actors.server.episode_log import EpisodeLog
from specroll.actors.server.errors import ApiError
from specroll.actors.server.sessions import Sessions
from specroll.actors.server.stitch import Transcripts
from specroll.engine.loaders.tokenizer import Tokenizer
from specroll.protocol.messages import RolloutChunk
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import Group, QueueFull

log = logging.getLogger("specroll.server")

PauseMode = Literal["keep", "abort", "wait"]
RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 (seconds)."""
NO_GENERATOR_RETRY_S = 5
"""``Retry-After`` of a 503 while no generator is connected (seconds)."""


@dataclass(frozen=True)
class ServeRequest:
    """One request as the hub runs it: a prompt's token ids, ``n`` samples and their sampling, and
    what the server does with the text (``stop`` strings, special tokens)."""

    prompt_token_ids: list[int]
    n: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    session_id: str | None = None


class Generation:
    """One request in flight: its group in the hub and its choices as they stream in.

    :attr:`on_change` is called each time its group got tokens; :meth:`sync` then brings
    :attr:`choices` up to date.
    """

    def __init__(self, group: Group, request: ServeRequest, tokenizer: Tokenizer) -> None:
        self.group = group
        self.request = request
        self.choices = [ChoiceText(tokenizer, request.stop, request.skip_special_tokens,
                                   request.include_stop_str_in_output) for _ in group.samples]
        self._fed = [0] * len(group.samples)
        self.on_change: Callable[[], None] | None = None
        """Called when the group got tokens (set by whoever follows it)."""
        self.generators: list[str] = []
        """Every generator it was dispatched to, in order (more than one after a resume)."""

    @property
    def group_id(self) -> str:
        return self.group.group_id

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def notify(self) -> None:
        """New tokens arrived for the group (the hub's chunk callback)."""
        if self.group.generator is not None and (not self.generators or self.generators[-1] != self.group.generator):
            self.generators.append(self.group.generator)
        if self.on_change is not None:
            self.on_change()

    def abort(self) -> None:
        """End every unfinished choice with ``abort`` (a pause with ``mode=abort``)."""
        self.sync()
        for choice in self.choices:
            choice.finish("abort")
        self.notify()

    def sync(self) -> None:
        """Feed each choice the tokens its sample got since the last call, and its end."""
        for i, (sample, choice) in enumerate(zip(self.group.samples, self.choices, strict=True)):
            held = len(sample.token_ids)
            if held > self._fed[i]:
                start, self._fed[i] = self._fed[i], held
                choice.feed(sample.token_ids[start:], sample.logprobs[start:], sample.versions[start:])
            if sample.finish_reason is not None:
                choice.finish(sample.finish_reason)


class Wake:
    """Woken by any of several generations: :meth:`set` from the chunk callback, :meth:`wait` in
    the route following them."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, deadline: float) -> None:
        """Until :meth:`set` was called since the last wait.

        Raises:
            ApiError: 504 when ``deadline`` (``anyio.current_time()`` seconds) passes first.
        """
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                await self._event.wait()
        except TimeoutError:
            raise ApiError(504, "the request did not finish within server.request_timeout_s; it was aborted",
                           code="timeout") from None
        self._event = anyio.Event()


class Router:
    """Runs served requests on the hub's generators (module docstring).

    Args:
        client: the hub; its :attr:`~RolloutClient.on_chunk` is chained (a callback set before is
            still called).
        tokenizer: the policy's tokenizer.
        config: ``[server]``.
    """

    def __init__(self, client: RolloutClient, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.client, self.tokenizer, self.config = client, tokenizer, config
        self.sessions = Sessions(config.max_sessions, config.session_ttl_s)
        self.transcripts = Transcripts(config.stitch_sessions)
        """Each session's last chat turn, for the next one's token-in-token-out prompt (``stitch.py``)."""
        self.episodes = EpisodeLog()
        """The turns of the episodes a trainer opened (``episode_log.py``)."""
        self.live: dict[str, Generation] = {}
        """Requests dispatched or queued in the hub, by group id."""
        self.waiting = 0
        """Requests held while paused."""
        self.paused = False
        self._resumed = anyio.Event()
        self._idle = anyio.Event()
        self._before: Callable[[str, RolloutChunk], None] | None = client.on_chunk
        client.on_chunk = self._on_chunk
        self._before_drop: Callable[[Group], None] | None = client.on_drop
        client.on_drop = self._on_drop
        self.requests_total = 0
        self.rejected_total = 0

    @property
    def num_in_flight(self) -> int:
        return len(self.live) + self.waiting

    def _on_chunk(self, actor: str, chunk: RolloutChunk) -> None:
        if self._before is not None:
            self._before(actor, chunk)
        generation = self.live.get(chunk.group_id)
        if generation is not None:
            generation.notify()

    def _on_drop(self, group: Group) -> None:
        if self._before_drop is not None:
            self._before_drop(group)
        generation = self.live.get(group.group_id)
        if generation is not None:
            generation.notify()  # its route sees group.dropped and answers 503

    @contextlib.asynccontextmanager
    async def run(self, request: ServeRequest) -> AsyncIterator[Generation]:
        """Submit ``request`` and yield its :class:`Generation`; on leaving (finished, the client gone,
        an error) an unfinished group is aborted, which frees its pages on the generator.

        Raises:
            ApiError: 429 at ``server.max_requests_in_flight`` or a full hub queue
                (``trainer.max_queued_groups``); 503 with no generator connected; 504 when paused past
                ``server.request_timeout_s``.
        """
        if self.num_in_flight >= self.config.max_requests_in_flight:
            self.rejected_total += 1
            raise ApiError(429, f"{self.num_in_flight} requests in flight, the limit (server.max_requests_in_flight) "
                           f"is {self.config.max_requests_in_flight}; retry later", code="too_many_requests",
                           retry_after_s=RETRY_AFTER_S)
        deadline = anyio.current_time() + self.config.request_timeout_s
        await self._wait_resumed(deadline)
        if not self.client.coordinator.generators:
            raise ApiError(503, "no generator is connected; retry once one is", code="no_generator",
                           retry_after_s=NO_GENERATOR_RETRY_S)
        pin = self.sessions.get(request.session_id) if request.session_id is not None else None
        try:
            group_id = await self.client.submit(request.prompt_token_ids, request.n, request.sampling, lane="serve",
                                                pin=pin)
        except QueueFull as e:
            self.rejected_total += 1
            raise ApiError(429, f"the generators' queue is full: {e}; retry later", code="queue_full",
                           retry_after_s=RETRY_AFTER_S) from None
        generation = Generation(self.client.coordinator.groups[group_id], request, self.tokenizer)
        generation.notify()  # dispatched already, if a generator had room
        self.live[group_id] = generation
        self.requests_total += 1
        try:
            yield generation
        finally:
            del self.live[group_id]
            if not self.live:
                self._idle.set()
            if generation.group.generator is not None and request.session_id is not None:
                self.sessions.record(request.session_id, generation.group.generator)
            if not generation.group.finished and group_id in self.client.coordinator.groups:
                with anyio.CancelScope(shield=True):
                    await self.client.abort(group_id)

    async def end_early(self, generation: Generation) -> None:
        """Every choice ended (stop strings): stop the rest of the group on its generator."""
        if generation.finished and generation.group_id in self.client.coordinator.groups:
            await self.client.abort(generation.group_id)

    def deadline(self) -> float:
        """``anyio.current_time()`` seconds by which a request starting now must finish."""
        return anyio.current_time() + self.config.request_timeout_s

    async def _wait_resumed(self, deadline: float) -> None:
        if not self.paused:
            return
        self.waiting += 1
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                while self.paused:
                    await self._resumed.wait()
                return
            raise ApiError(504, "the server stayed paused past server.request_timeout_s", code="paused")
        finally:
            self.waiting -= 1

    async def pause(self, mode: PauseMode, timeout_s: float = math.inf) -> None:
        """Hold new requests until :meth:`resume` (vLLM's ``/pause``): ``keep`` lets the requests in
        flight go on (weights change between engine steps without draining; ``token_versions`` show
        where); ``abort`` ends them now with finish reason ``abort``; ``wait`` returns once they finished.

        Raises:
            TimeoutError: ``wait`` took longer than ``timeout_s``.
        """
        self.paused = True
        if mode == "abort":
            for generation in list(self.live.values()):
                generation.abort()
                if generation.group_id in self.client.coordinator.groups:
                    await self.client.abort(generation.group_id)
        elif mode == "wait":
            with anyio.fail_after(timeout_s):
                while self.live:
                    self._idle = anyio.Event()
                    await self._idle.wait()

    def resume(self) -> None:
        """Let held and new requests run again (vLLM's ``/resume``)."""
        self.paused = False
        self._resumed.set()
        self._resumed = anyio.Event()
