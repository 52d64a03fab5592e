"""A generator's side of new policy versions: which announced version it fetches, over which
transport, and the transfer until the version is complete and queued for the step loop.

``WeightsAvailable`` → ``FetchWeights`` → ``WeightsChunk``s, assembled and checked by
:class:`~specroll.actors.peer.weights_fetch.WeightsFetch`; with ``network.weights_transport =
"collective"`` and the generator's weights group ready (``weights_group.py``),
``FetchWeights(transport="collective")`` instead, the tensors arriving as checked broadcasts. One
fetch at a time, of the newest version announced above the one served: a newer announcement
supersedes a transfer still under way (the trainer moved on, or restarted, and will never finish
it); a version that failed is fetched again only when announced again. The step loop applies a
complete version between engine steps (``actor.py``) and then reports it here (:meth:`PolicyUpdates.applied`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specroll.actors.generator.weights_group import Result, WeightsGroupLink
from specroll.actors.peer.weights_fetch import FetchAbandoned, WeightsFetch, check_announcement
from specroll.engine.engine import Engine
from specroll.engine.model_config import expected_weight_shapes
from specroll.protocol.messages import Error, FetchWeights, WeightsAvailable, WeightsChunk
from specroll.protocol.weights_collective import ChecksumMismatch, CollectiveError

log = logging.getLogger("specroll.generator")


@dataclass
class ReadyWeights:
    """A complete policy version, queued for the step loop."""

    version: int
    tensors: dict[str, torch.Tensor]
    fetch_started: float
    """When its fetch started (``time.monotonic()``)."""


class PolicyUpdates:
    """The policy versions a generator is told of and fetches (module docstring).

    Args:
        engine: the generator's engine: the version it serves, its model's parameters (what a
            version may hold) and its device; only read here.
        put: queues a message to the trainer.
        ready: queues a complete version for the step loop (and wakes it).
        collective: ``network.weights_transport == "collective"``.
        trainer_host: the trainer's host, where the weights group's rank 0 listens.
    """

    def __init__(self, engine: Engine, put: Callable[[object], None], ready: Callable[[ReadyWeights], None], *,
                 collective: bool, trainer_host: str) -> None:
        self.engine = engine
        self._put = put
        self._ready = ready
        self.weight_shapes = expected_weight_shapes(engine.model_config)
        """The model's parameters: what a policy version may hold."""
        self.announced: WeightsAvailable | None = None
        self.fetch: WeightsFetch | None = None
        self.fetch_started = 0.0
        """When the current fetch started (``time.monotonic()``)."""
        self.group = WeightsGroupLink(collective, engine.device, put, self._on_broadcast_result,
                                      trainer_host=trainer_host)
        """This generator's weights group with the trainer (``collective``)."""

    def check(self, msg: WeightsAvailable) -> None:
        """Bound an announcement by this model before anything is fetched.

        Raises:
            ~specroll.protocol.limits.LimitExceeded: naming the field, its value and the limit.
        """
        check_announcement(msg, self.weight_shapes)

    def on_announced(self, msg: WeightsAvailable) -> None:
        """A new version was announced: fetch it when it is newer than what is served or fetched."""
        self.announced = msg
        f = self.fetch
        if f is not None and f.version < msg.version and not f.complete:
            # A newer version supersedes a transfer still under way (the trainer moved on or
            # restarted and will never finish the old one): drop it, fetch the new one.
            log.info("policy version %d supersedes the unfinished fetch of %d", msg.version, f.version)
            self.fetch = None
        self.group.on_announced(msg)
        self._maybe_fetch()

    def on_chunk(self, msg: WeightsChunk, tensors: dict[str, torch.Tensor]) -> str | None:
        """Add a received chunk to the fetch; a version it completes goes to the step loop. Returns why
        the chunk is refused (to be answered with an ``Error``), or ``None``."""
        f = self.fetch
        if (f is None or msg.version != f.version) and self.announced is not None \
                and msg.version < self.announced.version:
            return None  # a chunk of a superseded transfer, still in flight: nothing to do with it
        if f is None or msg.version != f.version or f.complete:
            return (f"weights chunk {msg.index} of version {msg.version} was not fetched "
                    f"(fetching {f.version if f else None})")
        try:
            complete = f.add(msg, tensors)
        except FetchAbandoned as e:
            self.fetch = None  # the version is unusable; a later WeightsAvailable starts over
            self._forget_announcement(msg.version)
            return f"{e} (fetch abandoned)"
        if complete is not None:  # the step loop applies it (the fetch stays until then)
            self._ready(ReadyWeights(msg.version, complete, self.fetch_started))
        return None

    def applied(self, version: int, *, refused: bool) -> None:
        """The step loop applied ``version`` (or the engine ``refused`` it: not fetched again until
        announced again); fetch the next one if any."""
        if refused:
            self._forget_announcement(version)
        self.fetch = None
        self._maybe_fetch()

    def reset(self) -> None:
        """A restarted trainer numbers its own versions and never answers the old one's fetches:
        forget those fetches and announcements, and the weights group."""
        self.announced, self.fetch = None, None
        self.group.reset()

    def _maybe_fetch(self) -> None:
        """Fetch the newest announced version when it is newer than what is served or fetched."""
        a = self.announced
        if a is None or self.fetch is not None or a.version <= self.engine.weight_version:
            return
        self.fetch = WeightsFetch.announced(a, self.weight_shapes)
        self.fetch_started = time.monotonic()
        if self.group.ready and a.transport == "collective":
            log.info("fetching policy version %d over the weights group (%d buckets)", a.version,
                     len(a.bucket_checksums))
            self.group.asked(a)
            self._put(FetchWeights(version=a.version, transport="collective"))
            return
        log.info("fetching policy version %d (%d chunks)", a.version, a.num_chunks)
        self._put(FetchWeights(version=a.version))

    def _on_broadcast_result(self, version: int, result: Result) -> None:
        """A version fetched over the weights group arrived (or failed): queue it for the step loop
        when it is still the one fetched; a corrupted one is refused, a failed group refetched as chunks."""
        f = self.fetch
        current = f is not None and f.version == version and not f.complete
        match result:
            case ChecksumMismatch():
                log.error("policy version %d refused, still serving %d: %s", version, self.engine.weight_version,
                          result)
                self._put(Error(code="bad_request", message=f"policy version {version} refused: {result}"[:500]))
                if current:
                    self.fetch = None
                    self._forget_announcement(version)  # fetched again only when announced again
            case CollectiveError():
                if current:
                    self.fetch = None
                    self._maybe_fetch()  # as chunks: the group is gone
            case dict():
                if not current:
                    log.info("policy version %d arrived after it was superseded; dropped", version)
                    return
                assert f is not None
                f.finish()
                self._ready(ReadyWeights(version, result, self.fetch_started))

    def _forget_announcement(self, version: int) -> None:
        """A fetch of ``version`` failed: do not fetch it again until it is announced again."""
        if self.announced is not None and self.announced.version == version:
            self.announced = None
