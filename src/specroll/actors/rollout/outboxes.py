"""The client's outgoing side: one ordered queue per peer, each drained by its own sender task, so a
peer that grants no credit (slow, or gone) holds up its own messages only; and best-effort replies
to peers that are not (or no longer) connected.

A message to a peer whose connection is gone (``EHOSTUNREACH``) is dropped, and the peer is declared
gone at once (``unroutable``): the message may have carried work (a generator's ``SubmitGroup``) that
the hub would otherwise wait for without end, and the peer, once it connects again, would see the gap
in our sequence numbers and register again anyway (``actors/peer/lifecycle.py``). What follows for it
is dropped, logged once per change of state — when the peer becomes unreachable, and when a message
reaches it again — not once per message.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import torch
import zmq
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from specroll.protocol.channel import Channel
from specroll.protocol.messages import Error

log = logging.getLogger("specroll.client")

Send = Callable[[str, Any, list[torch.Tensor] | None], None]
"""``send(actor_id, message, tensors)``: queue a message for a peer (:meth:`Mail.send`)."""
Outgoing = tuple[Any, list[torch.Tensor]]
"""A message and the tensors sent as its frames."""


class Outboxes:
    """Per-peer send queues over one ROUTER :class:`~specroll.protocol.channel.Channel`.

    Args:
        channel: the channel messages go out on.
        task_group: where the sender tasks run (cancelled with it).
        unroutable: called with a peer and what could not be routed to it (module docstring).
    """

    def __init__(self, channel: Channel[Any], task_group: TaskGroup,
                 unroutable: Callable[[str, str], None] = lambda actor, what: None) -> None:
        self._channel, self._tg, self._unroutable = channel, task_group, unroutable
        self._boxes: dict[str, MemoryObjectSendStream[Outgoing]] = {}
        self.unreachable: set[str] = set()
        """Peers whose last message could not be routed (their connection is gone)."""

    def put(self, actor: str, msg: Any, tensors: list[torch.Tensor] | None = None) -> None:
        """Queue ``msg`` for ``actor``, after everything queued for it before."""
        box = self._boxes.get(actor)
        if box is None:
            box, queued = anyio.create_memory_object_stream[Outgoing](math.inf)
            self._boxes[actor] = box
            self._tg.start_soon(self._send_loop, actor, box, queued)
        try:
            box.send_nowait((msg, tensors or []))
        except anyio.BrokenResourceError:  # its sender task ended: the client is closing
            log.debug("closing: %s to %s dropped", type(msg).__name__, actor)

    def reply(self, actor: str, msg: Any) -> None:
        """A best-effort answer to a peer that is not (or no longer) a generator here: sent only if
        it would not wait for credit, so a peer that never grants any cannot stall the client."""
        if actor and self._channel.can_send(actor.encode()):
            self._tg.start_soon(self._send_now, actor, msg)
        else:
            log.debug("no credit to answer %s with %s; dropped", actor, type(msg).__name__)

    def forget(self, actor: str) -> None:
        """Close a gone peer's queue: what it never got is dropped."""
        box = self._boxes.pop(actor, None)
        if box is not None:
            box.close()
        self.unreachable.discard(actor)

    async def flushed(self) -> None:
        """Return once every message queued so far was handed to the socket or dropped (its peer is
        gone or unreachable). A peer that grants no credit holds its queue: wrap this in a timeout."""
        marks = []
        for box in self._boxes.values():
            mark = anyio.Event()
            box.send_nowait((mark, []))
            marks.append(mark)
        for mark in marks:
            await mark.wait()

    async def _send_now(self, actor: str, msg: Any) -> None:
        try:
            with anyio.move_on_after(1.0):
                await self._channel.send(msg, peer=actor.encode())
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise

    async def _send_loop(
        self, actor: str, box: MemoryObjectSendStream[Outgoing], queued: MemoryObjectReceiveStream[Outgoing]
    ) -> None:
        async with queued:
            async for msg, tensors in queued:
                if isinstance(msg, anyio.Event):  # a mark of flushed(): everything queued before it is out
                    msg.set()
                    continue
                if self._boxes.get(actor) is not box:
                    continue  # the generator is gone (or came back as a new one): drop what it never got
                try:
                    await self._channel.send(msg, peer=actor.encode(), tensors=tensors)
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH:
                        raise
                    if actor in self.unreachable:
                        log.debug("peer %s is unreachable; dropping %s", actor, type(msg).__name__)
                    else:
                        self.unreachable.add(actor)
                        log.info("peer %s is unreachable (its connection is gone); dropping %s and what follows "
                                 "until it is back or declared gone", actor, type(msg).__name__)
                        self._unroutable(actor, type(msg).__name__)
                    continue
                if actor in self.unreachable:
                    self.unreachable.discard(actor)
                    log.info("peer %s is reachable again", actor)


class Mail:
    """Where the hub's messages go: a registered generator's or drafter trainer's own outbox, in
    order; to any other peer, a best-effort reply. Nothing goes out before :meth:`open`.

    Args:
        registered: whether an actor id is a registered generator or drafter trainer.
        unroutable: called with a registered peer and the message that could not be routed to it.
    """

    def __init__(self, registered: Callable[[str], bool],
                 unroutable: Callable[[str, str], None] = lambda actor, what: None) -> None:
        self._registered, self._unroutable = registered, unroutable
        self._channel: Channel[Any] | None = None
        self.errors_sent: Counter[str] = Counter()
        """``Error`` replies sent, by code: messages refused (``specroll:refusals``)."""
        self.outboxes: Outboxes | None = None

    def open(self, channel: Channel[Any], task_group: TaskGroup) -> None:
        """Send over ``channel`` from now on, the senders running in ``task_group``."""
        self._channel = channel
        self.outboxes = Outboxes(channel, task_group, self._unroutable)

    def send(self, actor: str, msg: Any, tensors: list[torch.Tensor] | None = None) -> None:
        """Queue ``msg`` (with the tensors sent as its frames) for ``actor``."""
        if isinstance(msg, Error):
            self.errors_sent[msg.code] += 1
        if self.outboxes is None:
            log.debug("not started: %s to %s dropped", type(msg).__name__, actor)
            return
        if not self._registered(actor):
            self.outboxes.reply(actor, msg)
            return
        self.outboxes.put(actor, msg, tensors)

    async def flush(self, timeout_s: float) -> None:
        """Wait until what is queued is sent (:meth:`Outboxes.flushed`), ``timeout_s`` at most; nothing
        to wait for before :meth:`open`."""
        if self.outboxes is not None:
            with anyio.move_on_after(timeout_s):
                await self.outboxes.flushed()

    def forget(self, actor: str) -> None:
        """Drop the outbox and the channel state of a peer that is gone."""
        if self.outboxes is not None:
            self.outboxes.forget(actor)
        if self._channel is not None:
            self._channel.forget(actor.encode())
