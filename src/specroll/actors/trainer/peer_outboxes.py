"""The client's outgoing side: one ordered queue per peer, each drained by its own sender task, so a
peer that grants no credit (slow, or gone) holds up its own messages only; and best-effort replies
to peers that are not (or no longer) connected.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
import torch
import zmq
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from specroll.protocol.channel import Channel

log = logging.getLogger("specroll.client")

Outgoing = tuple[Any, list[torch.Tensor]]
"""A message and the tensors sent as its frames."""


class Outboxes:
    """Per-peer send queues over one ROUTER :class:`~specroll.protocol.channel.Channel`.

    Args:
        channel: the channel messages go out on.
        task_group: where the sender tasks run (cancelled with it).
    """

    def __init__(self, channel: Channel[Any], task_group: TaskGroup) -> None:
        self._channel, self._tg = channel, task_group
        self._boxes: dict[str, MemoryObjectSendStream[Outgoing]] = {}

    def put(self, actor: str, msg: Any, tensors: list[torch.Tensor] | None = None) -> None:
        """Queue ``msg`` for ``actor``, after everything queued for it before."""
        box = self._boxes.get(actor)
        if box is None:
            box, queued = anyio.create_memory_object_stream[Outgoing](math.inf)
            self._boxes[actor] = box
            self._tg.start_soon(self._send_loop, actor, box, queued)
        box.send_nowait((msg, tensors or []))

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

    def pending(self) -> bool:
        """Whether any queue still holds a message."""
        return any(box.statistics().current_buffer_used for box in self._boxes.values())

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
                if self._boxes.get(actor) is not box:
                    return  # the generator is gone (or came back as a new one): drop what it never got
                try:
                    await self._channel.send(msg, peer=actor.encode(), tensors=tensors)
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH:
                        raise
                    log.info("peer %s is unreachable; dropping %s", actor, type(msg).__name__)
