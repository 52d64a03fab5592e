"""A policy version as one byte string: what the hub's snapshot, its chunks, its collective buckets
and a receiving peer all agree on.

**A version's bytes.** Its tensors, cast to the wire dtype, are laid end to end in the announced
order (:class:`WeightsLayout`) and broadcast in buckets of ``bucket_bytes``, each a slice of that
one byte string; a tensor may span buckets. Each bucket's CRC-32 (``zlib.crc32``, about 5 GB/s on
one core) is announced and checked on arrival: a mismatch refuses the version (nothing applied).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specroll.protocol.messages import TensorSpec

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a policy version travels in (``WeightsAvailable.dtype``)."""


@dataclass(frozen=True)
class WeightsLayout:
    """Where each tensor of a version lies in its byte string (C order, wire dtype, no padding).

    All tensors share one dtype, so every offset is a multiple of its element size."""

    dtype: torch.dtype
    entries: tuple[tuple[str, tuple[int, ...], int], ...]
    """``(name, shape, byte offset)`` in announced order."""
    total_bytes: int

    @classmethod
    def of(cls, params: Sequence[TensorSpec], dtype: str) -> WeightsLayout:
        """The layout of ``params`` (``WeightsAvailable.params``) in wire dtype ``dtype``.

        Raises:
            ValueError: a dtype outside :data:`WIRE_DTYPES`.
        """
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"weights dtype {dtype!r}, expected one of {sorted(WIRE_DTYPES)}")
        torch_dtype = WIRE_DTYPES[dtype]
        size = torch_dtype.itemsize
        entries, offset = [], 0
        for p in params:
            entries.append((p.name, tuple(p.shape), offset))
            offset += size * _numel(p.shape)
        return cls(torch_dtype, tuple(entries), offset)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name → tensor of ``flat``'s bytes (views, no copy).

        Args:
            flat: uint8 ``[total_bytes]``, contiguous, on any device.
        """
        assert flat.dtype == torch.uint8 and flat.shape == (self.total_bytes,), (flat.dtype, flat.shape)
        size = self.dtype.itemsize
        return {name: flat[offset:offset + size * _numel(shape)].view(self.dtype).view(shape)
                for name, shape, offset in self.entries}

    def flatten(self, named: dict[str, torch.Tensor]) -> torch.Tensor:
        """One CPU byte string (uint8 ``[total_bytes]``) of ``named``'s tensors, each cast to the wire
        dtype and copied into its slice (the snapshot a version is sent from)."""
        flat = torch.empty(self.total_bytes, dtype=torch.uint8)  # [total_bytes]
        for name, view in self.views(flat).items():
            view.copy_(named[name].detach())  # casts and moves to the CPU in one copy
        return flat


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bucket_ranges(total_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each bucket of a ``total_bytes`` string (none for an empty one)."""
    assert bucket_bytes > 0
    return [(s, min(s + bucket_bytes, total_bytes)) for s in range(0, total_bytes, bucket_bytes)]


def bucket_checksums(flat: torch.Tensor, bucket_bytes: int) -> list[int]:
    """CRC-32 (``zlib.crc32``) of each bucket of the CPU byte string ``flat`` (uint8 ``[N]``)."""
    data = memoryview(flat.numpy())
    return [zlib.crc32(data[s:e]) for s, e in bucket_ranges(flat.numel(), bucket_bytes)]
