"""The trainer's end of the weights groups: one 2-member torch.distributed group per generator that
asks for one (why one per generator: ``protocol/weights_collective.py``).

* ``JoinWeightsGroup`` → :meth:`WeightsGroups.join`: the group's task opens a store server on the
  client's host (a free port), answers ``WeightsGroup(name, host, port, backend, timeout_s)`` (or
  ``WeightsGroup(refused=...)``) and builds rank 0's end while the generator builds rank 1's, each
  blocking call in a daemon thread. Any earlier group of that generator is dropped.
* ``FetchWeights(transport="collective")`` → :meth:`WeightsGroups.fetch`: the group's task (one per
  group) serves its fetches in order once the group is built: ``WeightsBroadcast(version, group)``
  is queued, then the version's byte string is broadcast in buckets. The generator receives in the
  order of the ``WeightsBroadcast`` messages, so the group stays in step; a fetch of a version no
  longer the latest is answered with the ``Error`` naming the current one, as for chunks.
* A group that cannot be opened or built, or whose broadcast fails (timeout, generator gone), is
  dropped, logged once per generator, and that generator's fetches are answered with chunks from
  then on, as they are for a peer without a group (the drafter trainer).
* :meth:`drop` when the generator is declared gone: its group is forgotten (an operation under way
  fails at once when the generator's process is gone, or after ``timeout_s``).
Security: ``WeightsGroup`` (the store's host and port) goes only to a generator the trainer
admitted, over its channel (CURVE-encrypted with ``network.security = "curve"``), and the buckets'
CRC-32 travel the same way. The store and the gloo/NCCL connections themselves have no
authentication or encryption in torch.distributed (``TCPStore`` takes whoever connects first to a
rank slot, and the bytes cross in the clear), so this path needs a cluster-internal network; the
CRC-32 catches corruption, not a forger.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from specroll.actors.rollout.weights_publish import PublishedWeights
from specroll.actors.shared.wakeup import Wakeup
from specroll.protocol.messages import CollectiveBackend, JoinWeightsGroup, WeightsBroadcast, WeightsGroup
from specroll.protocol.weights_collective import (
    CollectiveError,
    build_group,
    in_daemon_thread,
    open_store,
    send_buckets,
)

log = logging.getLogger("specroll.client")

BackendChoice = Literal["auto", "gloo", "nccl"]
"""``network.weights_backend``: ``auto`` is NCCL when the trainer has CUDA and the generator's
engine is on CUDA, else gloo."""


@dataclass
class _Group:
    name: str
    backend: CollectiveBackend
    fetches: deque[int] = field(default_factory=deque)
    """Versions asked for and not yet served, in order."""
    wake: Wakeup = field(default_factory=Wakeup)
    dropped: bool = False


class WeightsGroups:
    """Weights groups with the generators, by actor id (module docstring).

    Args:
        published: the client's published weights (the byte string of the latest version).
        host: the address stores and gloo sockets bind (the client's ``network.host``).
        backend: ``network.weights_backend``.
        timeout_s: the limit of every group's setup and operations (``network.heartbeat_timeout_s``).
        queue: sends a message to a peer through its outbox (the client's ``_queue``).
        send_chunks: answers a fetch with chunks (the fallback).
        start_soon: starts a task in the client's task group.
    """

    def __init__(self, published: PublishedWeights, host: str, backend: BackendChoice, timeout_s: float,
                 queue: Callable[[str, Any], None], send_chunks: Callable[[str, int], None],
                 start_soon: Callable[..., None]) -> None:
        self.published, self.host, self.backend, self.timeout_s = published, host, backend, timeout_s
        self._queue, self._send_chunks, self._start_soon = queue, send_chunks, start_soon
        self._groups: dict[str, _Group] = {}
        self._failed: set[str] = set()
        """Generators whose group failed: their fetches get chunks (logged once each)."""
        self._names = itertools.count()
        self.broadcasts: dict[str, int] = {}
        """Versions sent over a group, by generator (counted across its groups)."""

    def group_name(self, actor: str) -> str | None:
        """The name of ``actor``'s group (built or being built), None when it has none."""
        group = self._groups.get(actor)
        return None if group is None else group.name

    def join(self, actor: str, msg: JoinWeightsGroup) -> None:
        """Open a group for ``actor`` (dropping its earlier one) and answer ``WeightsGroup``."""
        self.drop(actor)
        if actor in self._failed:
            self._queue(actor, WeightsGroup(name="", host="", port=0, refused="an earlier weights group with this "
                                            "generator failed; its weights travel as chunks"))
            return
        backend: CollectiveBackend = self.backend if self.backend != "auto" else (
            "nccl" if msg.device == "cuda" and torch.cuda.is_available() else "gloo")
        group = _Group(f"weights-{next(self._names)}", backend)
        self._groups[actor] = group
        self._start_soon(self._serve, actor, group)

    def fetch(self, actor: str, version: int) -> None:
        """Answer ``FetchWeights(version, transport="collective")`` from ``actor``: over its group
        (after the broadcasts asked for before), or with chunks when it has none."""
        group = self._groups.get(actor)
        if group is None:
            if actor not in self._failed:
                log.info("%s fetches version %d over a weights group it has not joined: chunks", actor, version)
            self._send_chunks(actor, version)
            return
        group.fetches.append(version)
        group.wake.notify()

    async def _serve(self, actor: str, group: _Group) -> None:
        """Open the store and answer ``WeightsGroup``, build rank 0's end of ``group``, then serve its
        fetches in order until it is dropped or fails."""
        try:
            try:
                store = await in_daemon_thread(open_store, self.host, self.timeout_s)
            except CollectiveError as e:
                self._queue(actor, WeightsGroup(name="", host="", port=0, refused=str(e)[:500]))
                self._fail(actor, group, str(e))
                return
            self._queue(actor, WeightsGroup(name=group.name, host=self.host, port=store.port, backend=group.backend,
                                            timeout_s=self.timeout_s))
            try:
                end = await in_daemon_thread(build_group, group.name, group.backend, 0, self.host, self.timeout_s,
                                             store)
            except CollectiveError as e:
                self._fail(actor, group, str(e))
                return
            log.info("weights group %s with %s is up (%s, store %s:%d)", group.name, actor, group.backend, self.host,
                     store.port)
            while not group.dropped:
                if not group.fetches:
                    await group.wake.wait()
                    continue
                version = group.fetches.popleft()
                flat = self.published.latest_bytes(version)
                if flat is None:  # superseded meanwhile: the Error naming the current version
                    self._send_chunks(actor, version)
                    continue
                self._queue(actor, WeightsBroadcast(version=version, group=group.name))
                try:
                    await in_daemon_thread(send_buckets, end, flat, self.published.bucket_bytes)
                except CollectiveError as e:
                    self._fail(actor, group, str(e))
                    return
                self.broadcasts[actor] = self.broadcasts.get(actor, 0) + 1
        finally:
            # Fetches still queued are dropped: the generator's end fails with this one (same
            # collective, or its peer gone) and fetches those versions again as chunks.
            group.dropped = True
            group.fetches.clear()

    def drop(self, actor: str) -> None:
        """Forget ``actor``'s group (it is gone, or asked for a new one); its task ends."""
        group = self._groups.pop(actor, None)
        if group is not None:
            group.dropped = True
            group.wake.notify()

    def forget(self, actor: str) -> None:
        """``actor`` is gone for good: drop its group and its failure record."""
        self.drop(actor)
        self._failed.discard(actor)

    def _fail(self, actor: str, group: _Group, why: str) -> None:
        """A group failed: drop it, fall back to chunks, log once."""
        if self._groups.get(actor) is not group:
            return  # an old group of a generator that joined again or is gone
        self.drop(actor)
        if actor not in self._failed:
            self._failed.add(actor)
            log.warning("weights group with %s failed (%s); its weights travel as ZeroMQ chunks from now on",
                        actor, why)
