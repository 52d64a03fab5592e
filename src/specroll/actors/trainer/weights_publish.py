"""The policy weights a :class:`~specroll.actors.trainer.client.RolloutClient` publishes: the latest
version, snapshotted in the wire dtype and split into ``WeightsChunk`` messages of at most about
:data:`WEIGHTS_CHUNK_BYTES` of tensors, announced by one ``WeightsAvailable``; generators and
drafter trainers fetch it with ``FetchWeights``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specroll.protocol.codec import pack_tensors
from specroll.protocol.messages import Error, TensorSpec, WeightsAvailable, WeightsChunk

WEIGHTS_CHUNK_BYTES = 64 << 20
"""Weights travel in messages of at most about this many bytes of tensors."""
_WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PublishedWeights:
    """The latest published policy version: its announcement and its chunks, ready to send."""

    def __init__(self) -> None:
        self._latest: tuple[WeightsAvailable, list[tuple[WeightsChunk, list[torch.Tensor]]]] | None = None

    @property
    def announcement(self) -> WeightsAvailable | None:
        """The ``WeightsAvailable`` of the latest version (None before the first publish)."""
        return None if self._latest is None else self._latest[0]

    def answer_fetch(self, version: int) -> list[tuple[WeightsChunk | Error, list[torch.Tensor]]]:
        """The messages (with their tensors) that answer ``FetchWeights(version)``: the chunks of
        ``version``, in order, or one ``Error`` when it is not the latest version published."""
        if self._latest is None or self._latest[0].version != version:
            have = None if self._latest is None else self._latest[0].version
            return [(Error(code="bad_request", message=f"weights version {version} is not published "
                                                       f"(current: {have})"), [])]
        return list(self._latest[1])

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int, dtype: str) -> WeightsAvailable:
        """Make ``version`` the latest: snapshot the tensors (cast to ``dtype``, on the CPU, so the
        caller may go on changing the originals) and split them into chunks. Returns its announcement.

        Raises:
            ValueError: an unknown dtype or a version not above the last published one.
        """
        if dtype not in _WIRE_DTYPES:
            raise ValueError(f"weights dtype {dtype!r}, expected one of {sorted(_WIRE_DTYPES)}")
        if self._latest is not None and version <= self._latest[0].version:
            raise ValueError(f"weight version {version} is not above the published {self._latest[0].version}")
        items = dict(named_tensors).items()
        snapshot = [(name, t.detach().to("cpu", _WIRE_DTYPES[dtype]).contiguous().clone()) for name, t in items]
        groups: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, t in snapshot:
            if groups[-1] and size + t.numel() * t.element_size() > WEIGHTS_CHUNK_BYTES:
                groups.append([])
                size = 0
            groups[-1].append((name, t))
            size += t.numel() * t.element_size()
        chunks = []
        for index, group in enumerate(groups):
            refs, tensors = pack_tensors(group)
            chunks.append((WeightsChunk(version=version, index=index, num_chunks=len(groups), tensors=refs), tensors))
        announce = WeightsAvailable(version=version, dtype=dtype, num_chunks=len(groups),
                                    params=[TensorSpec(name=n, shape=tuple(t.shape)) for n, t in snapshot])
        self._latest = (announce, chunks)
        return announce
