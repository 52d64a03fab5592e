"""A generator's end of its weights group with the trainer (``network.weights_transport =
"collective"``; the design: ``protocol/weights_collective.py``).

States: ``off`` (transport ``zmq``: never asks) → ``idle`` → (an announcement with
``transport="collective"``: ``JoinWeightsGroup`` sent) ``joining`` → (``WeightsGroup`` answered,
rank 1's end built in a daemon thread) ``ready`` | ``failed``. While not ``ready`` every version is
fetched as chunks, so the first version after a (re)start never waits for the group. ``failed`` (a
refusal, a setup or broadcast failure: logged once) lasts until the trainer restarts
(:meth:`WeightsGroupLink.reset`, back to ``idle``); the generator then fetches chunks.

Receiving: every ``WeightsBroadcast`` for a version this generator asked over the group is received
in arrival order by one task (:meth:`WeightsGroupLink.run`), even when a newer version superseded
it meanwhile: the trainer is already sending it, and skipping it would put the group out of step.
Each result — the tensors, a :class:`~specroll.protocol.weights_collective.ChecksumMismatch` or a
:class:`~specroll.protocol.weights_collective.CollectiveError` — goes to ``on_result``, which
decides what to apply (``policy_updates.py``).

Every version is received into one reused buffer (first-touch page faults of a new one cost about
as much as the transfer on a CPU). That is safe because a receive never overlaps the apply of the
one before: a result the actor applies is of its current fetch, and the actor asks for nothing
more until that fetch is applied (``PolicyUpdates._maybe_fetch``), so no broadcast is queued
behind it; a result it drops is not read again. After :meth:`WeightsGroupLink.reset` a new buffer
is used (a receive of the old trainer may still be writing the old one).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Literal

import torch

from specroll.actors.shared.wakeup import Wakeup
from specroll.protocol.limits import MAX_ID_CHARS
from specroll.protocol.messages import JoinWeightsGroup, WeightsAvailable, WeightsBroadcast, WeightsGroup
from specroll.protocol.weights_collective import (
    ChecksumMismatch,
    CollectiveError,
    GroupEnd,
    build_group,
    in_daemon_thread,
    receive_buckets,
)
from specroll.protocol.weights_layout import WeightsLayout

log = logging.getLogger("specroll.generator")

_WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
LinkState = Literal["off", "idle", "joining", "ready", "failed"]
Result = dict[str, torch.Tensor] | ChecksumMismatch | CollectiveError
"""What a broadcast brought: the version's tensors (wire dtype), or why it brought nothing usable."""


class WeightsGroupLink:
    """The generator's end of its weights group (module docstring).

    Args:
        enabled: ``network.weights_transport == "collective"``.
        device: the engine's device (``cuda`` lets the trainer choose NCCL).
        put: queues a message for the trainer (``PeerConnection.put``).
        on_result: called in the event loop with ``(version, result)`` after each broadcast.
        trainer_host: the host of the trainer's endpoint this generator connected to: used instead of
            a wildcard store address (a trainer bound to ``0.0.0.0`` cannot know which of its
            addresses reaches this generator; the one it was reached at does).
    """

    def __init__(self, enabled: bool, device: torch.device, put: Callable[[object], None],
                 on_result: Callable[[int, Result], None], trainer_host: str | None = None) -> None:
        self.enabled, self.device, self.trainer_host = enabled, device, trainer_host
        self._put, self._on_result = put, on_result
        self.state: LinkState = "idle" if enabled else "off"
        self._end: GroupEnd | None = None
        self._asked: dict[int, WeightsAvailable] = {}
        """Versions fetched over the group whose broadcast has not begun: their announcements."""
        self._jobs: deque[tuple[int, WeightsGroup | WeightsBroadcast]] = deque()
        """``(epoch, job)``: joins and receives, in arrival order."""
        self._wake = Wakeup()
        self._buffer: torch.Tensor | None = None
        """The receive buffer, uint8 ``[total_bytes]`` of the last version (reused when the size matches)."""
        self._epoch = 0
        """Bumped by :meth:`reset`: a job of an older epoch belongs to the previous trainer."""

    @property
    def ready(self) -> bool:
        """Versions may be fetched over the group."""
        return self.state == "ready"

    def on_announced(self, a: WeightsAvailable) -> None:
        """Ask for a group the first time the trainer offers its versions over groups."""
        if self.state == "idle" and a.transport == "collective":
            self.state = "joining"
            self._put(JoinWeightsGroup(device="cuda" if self.device.type == "cuda" else "cpu"))

    def asked(self, a: WeightsAvailable) -> None:
        """Version ``a.version`` is fetched over the group (``FetchWeights(transport="collective")`` sent)."""
        self._asked[a.version] = a

    def on_group(self, msg: WeightsGroup) -> str | None:
        """The trainer's answer to ``JoinWeightsGroup``; returns why it is refused, if it is."""
        if self.state != "joining":
            return f"WeightsGroup {msg.name!r} was not asked for (weights group {self.state})"
        if msg.refused:
            self._fail(f"the trainer refused: {msg.refused[:300]}")
        elif not 0 < msg.timeout_s < float("inf") or not 0 < len(msg.name) <= MAX_ID_CHARS:
            self._fail(f"WeightsGroup name={msg.name[:MAX_ID_CHARS]!r} timeout_s={msg.timeout_s}: expected a name of "
                       f"1..{MAX_ID_CHARS} characters and a positive finite timeout")
        else:
            self._jobs.append((self._epoch, msg))
            self._wake.notify()
        return None

    def on_broadcast(self, msg: WeightsBroadcast) -> str | None:
        """The trainer broadcasts version ``msg.version`` now: receive it; returns why it is refused
        (a broadcast never asked for, or on another group), if it is."""
        if self.state != "ready" or self._end is None or msg.group != self._end.name:
            return (f"WeightsBroadcast of version {msg.version} on group {msg.group!r}: this generator's group is "
                    f"{self._end.name if self._end else None!r} ({self.state})")
        if msg.version not in self._asked:
            return f"WeightsBroadcast of version {msg.version}, which was not fetched over the group"
        self._jobs.append((self._epoch, msg))
        self._wake.notify()
        return None

    def reset(self) -> None:
        """A new trainer: forget the group and the jobs of the old one (a receive under way fails
        on its own once the old trainer is gone); ask again at its first collective announcement."""
        self._epoch += 1
        self._end, self._buffer = None, None
        self._asked.clear()
        self._jobs.clear()
        self.state = "idle" if self.enabled else "off"

    async def run(self) -> None:
        """Join and receive, one job at a time, in a daemon thread each; never returns."""
        while True:
            while not self._jobs:
                await self._wake.wait()
            epoch, job = self._jobs.popleft()
            match job:
                case WeightsGroup():
                    await self._join(epoch, job)
                case WeightsBroadcast():
                    await self._receive(epoch, job)

    async def _join(self, epoch: int, msg: WeightsGroup) -> None:
        host = self.trainer_host if msg.host in _WILDCARD_HOSTS and self.trainer_host else msg.host
        try:
            end = await in_daemon_thread(build_group, msg.name, msg.backend, 1, host, msg.timeout_s, None,
                                         msg.port)
        except CollectiveError as e:
            if epoch == self._epoch:
                self._fail(str(e))
            return
        if epoch == self._epoch:
            self._end, self.state = end, "ready"
            log.info("joined weights group %s (%s) at %s:%d", msg.name, msg.backend, host, msg.port)

    async def _receive(self, epoch: int, msg: WeightsBroadcast) -> None:
        a, end = self._asked.pop(msg.version, None), self._end
        for v in [v for v in self._asked if v < msg.version]:
            del self._asked[v]  # answered otherwise (an Error): no broadcast of them will come
        if a is None or end is None or epoch != self._epoch:
            return  # the group failed or the trainer changed since the job was queued
        layout = WeightsLayout.of(a.params, a.dtype)
        if self._buffer is None or self._buffer.shape != (layout.total_bytes,) or self._buffer.device != end.device:
            self._buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=end.device)  # [total_bytes]
        result: Result
        try:
            result = await in_daemon_thread(receive_buckets, end, layout, a.bucket_bytes, a.bucket_checksums,
                                            self._buffer)
        except (ChecksumMismatch, CollectiveError) as e:
            result = e
        if epoch != self._epoch:
            return
        self._on_result(msg.version, result)
        if isinstance(result, CollectiveError):
            self._fail(str(result))

    def _fail(self, why: str) -> None:
        """The group is unusable: chunks from now on. Every version asked over it and not yet
        received is reported failed, so the actor fetches it again (as chunks)."""
        pending = sorted({*self._asked, *(job.version for _, job in self._jobs if isinstance(job, WeightsBroadcast))})
        self._end, self.state = None, "failed"
        self._asked.clear()
        self._jobs.clear()
        log.warning("weights group unusable (%s); fetching policy weights as ZeroMQ chunks", why)
        for version in pending:
            self._on_result(version, CollectiveError(why))
