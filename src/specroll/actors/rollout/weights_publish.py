"""The policy weights a :class:`~specroll.actors.rollout.client.RolloutClient` publishes: the latest
version, snapshotted in the wire dtype into one byte string (``WeightsLayout``) and split into
``WeightsChunk`` messages of at most about :data:`WEIGHTS_CHUNK_BYTES` of tensors, announced by one
``WeightsAvailable``; generators and drafter trainers fetch it with ``FetchWeights``. With the
``collective`` transport the announcement also carries the bucket size and each bucket's CRC-32, and
the same byte string is what the weights groups broadcast (``weights_groups.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specroll.protocol.codec import pack_tensors
from specroll.protocol.messages import Error, TensorSpec, WeightsAvailable, WeightsChunk, WeightsTransport
from specroll.protocol.weights_layout import WIRE_DTYPES, WeightsLayout, bucket_checksums

WEIGHTS_CHUNK_BYTES = 64 << 20
"""Weights travel in messages of at most about this many bytes of tensors."""


class PublishedWeights:
    """The latest published policy version: its announcement, its byte string and its chunks.

    Args:
        transport: ``collective`` also announces buckets of ``bucket_bytes`` with their checksums.
        bucket_bytes: bytes per broadcast bucket (``network.weights_bucket_mb``).
    """

    def __init__(self, transport: WeightsTransport = "zmq", bucket_bytes: int = 64 << 20) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}, expected a positive number of bytes")
        self.transport, self.bucket_bytes = transport, bucket_bytes
        self._latest: tuple[WeightsAvailable, list[tuple[WeightsChunk, list[torch.Tensor]]], torch.Tensor] | None = None

    @property
    def announcement(self) -> WeightsAvailable | None:
        """The ``WeightsAvailable`` of the latest version (None before the first publish)."""
        return None if self._latest is None else self._latest[0]

    def latest_bytes(self, version: int) -> torch.Tensor | None:
        """The byte string (uint8 ``[N]``, CPU) of ``version`` if it is the latest, else None."""
        if self._latest is None or self._latest[0].version != version:
            return None
        return self._latest[2]

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
        caller may go on changing the originals) into one byte string, split it into chunks (views
        of it) and, for ``collective``, checksum its buckets. Returns its announcement.

        Raises:
            ValueError: an unknown dtype or a version not above the last published one.
        """
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"weights dtype {dtype!r}, expected one of {sorted(WIRE_DTYPES)}")
        if self._latest is not None and version <= self._latest[0].version:
            raise ValueError(f"weight version {version} is not above the published {self._latest[0].version}")
        named = dict(named_tensors)
        params = [TensorSpec(name=n, shape=tuple(t.shape)) for n, t in named.items()]
        layout = WeightsLayout.of(params, dtype)
        flat = layout.flatten(named)  # [total_bytes] uint8
        snapshot = list(layout.views(flat).items())
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
        announce = WeightsAvailable(version=version, dtype=dtype, num_chunks=len(groups), params=params)
        if self.transport == "collective":
            announce = WeightsAvailable(version=version, dtype=dtype, num_chunks=len(groups), params=params,
                                        transport="collective", bucket_bytes=self.bucket_bytes,
                                        bucket_checksums=tuple(bucket_checksums(flat, self.bucket_bytes)))
        self._latest = (announce, chunks, flat)
        return announce
