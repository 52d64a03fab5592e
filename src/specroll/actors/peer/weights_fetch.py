"""Receiving one policy version from the trainer: ``WeightsChunk`` frames, in order, into one dict.

Generators and the drafter trainer fetch policy weights the same way (``FetchWeights`` after a
``WeightsAvailable``, then ``num_chunks`` chunks); :class:`WeightsFetch` is the assembly and its
checks. What an actor does with a broken transfer differs (a generator answers with an ``Error``,
the drafter trainer logs and waits for the next announcement), so :meth:`WeightsFetch.add` raises
and leaves the answer to the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from specroll.protocol.messages import WeightsAvailable, WeightsChunk


class FetchAbandoned(Exception):
    """A transfer that cannot make a valid version (the message says why); fetch it anew."""


@dataclass
class WeightsFetch:
    """A policy version being fetched: chunks arrive in order (``WeightsChunk.index`` 0, 1, …)."""

    version: int
    num_chunks: int
    names: frozenset[str] | None
    """The announced parameter names (``WeightsAvailable.params``); ``None``: not checked."""
    next_index: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def announced(cls, a: WeightsAvailable) -> WeightsFetch:
        """The fetch of the version ``a`` announces."""
        return cls(a.version, a.num_chunks, frozenset(p.name for p in a.params))

    @property
    def complete(self) -> bool:
        return self.next_index >= self.num_chunks

    def add(self, msg: WeightsChunk, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Add chunk ``msg`` (of this version) with its tensors.

        Returns:
            Every tensor of the version once its last chunk arrived, else ``None``.

        Raises:
            FetchAbandoned: the chunk is out of order, or of another chunk count; it repeats a
                tensor; or the complete version's tensors differ from the announced names.
        """
        assert msg.version == self.version and not self.complete, "a chunk of another transfer"
        if msg.index != self.next_index or msg.num_chunks != self.num_chunks:
            raise FetchAbandoned(f"weights chunk {msg.index}/{msg.num_chunks} of version {msg.version}; "
                                 f"expected chunk {self.next_index}/{self.num_chunks}")
        dup = self.tensors.keys() & tensors.keys()
        if dup:
            raise FetchAbandoned(f"version {msg.version} sends tensors {sorted(dup)[:3]} twice")
        self.tensors.update(tensors)
        self.next_index += 1
        if not self.complete:
            return None
        if self.names is not None and self.names != self.tensors.keys():
            raise FetchAbandoned(f"version {msg.version}: received tensors differ from the announced ones "
                                 f"(missing {sorted(self.names - self.tensors.keys())[:3]}, "
                                 f"extra {sorted(self.tensors.keys() - self.names)[:3]})")
        tensors, self.tensors = self.tensors, {}
        return tensors
