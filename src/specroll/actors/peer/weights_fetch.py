"""Receiving one policy version from the trainer: ``WeightsChunk`` frames, in order, into one dict.

Generators and the drafter trainer fetch policy weights the same way (``FetchWeights`` after a
``WeightsAvailable``, then ``num_chunks`` chunks); :class:`WeightsFetch` is the assembly and its
checks. What an actor does with a broken transfer differs (a generator answers with an ``Error``,
the drafter trainer logs and waits for the next announcement), so :meth:`WeightsFetch.add` raises
and leaves the answer to the caller.

What a version may hold is bounded by the receiver's own model before anything is fetched
(:func:`check_announcement`): no more tensors than the model has, only names it has, no more chunks
than tensors; each tensor's shape is checked against the model's as its chunk arrives. A version
also offered over weights groups (``transport="collective"``) is checked whole up front: the receiver
allocates its byte string from the announced shapes, so each must be the model's, and there must be
exactly one checksum per bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from specroll.protocol.limits import MAX_ID_CHARS, LimitExceeded, check_at_most
from specroll.protocol.messages import WeightsAvailable, WeightsChunk
from specroll.protocol.weights_layout import WeightsLayout
from specroll.protocol.weights_messages import MAX_BUCKETS

Shapes = Mapping[str, tuple[int, ...]]
"""Hugging Face parameter name → shape, of the receiver's own model."""


class FetchAbandoned(Exception):
    """A transfer that cannot make a valid version (the message says why); fetch it anew."""


def check_announcement(a: WeightsAvailable, model: Shapes) -> None:
    """Bound what fetching version ``a`` would bring, before it is fetched.

    Raises:
        LimitExceeded: more parameters than ``model`` has, a name it does not have (or longer than
            :data:`~specroll.protocol.limits.MAX_ID_CHARS`), a name twice, or more chunks than
            parameters (the trainer sends at least one tensor per chunk); with
            ``transport="collective"`` also a shape other than the model's, a bucket size of 0 or a
            checksum count other than the number of buckets; the message names the field, the
            value and the limit.
    """
    check_at_most(f"WeightsAvailable(version={a.version}).len(params)", len(a.params), len(model),
                  "the tensors of this model")
    check_at_most(f"WeightsAvailable(version={a.version}).num_chunks", a.num_chunks, max(1, len(a.params)),
                  "len(params): every chunk carries at least one tensor")
    seen: set[str] = set()
    for i, p in enumerate(a.params):
        check_at_most(f"WeightsAvailable(version={a.version}).len(params[{i}].name)", len(p.name), MAX_ID_CHARS,
                      "protocol limit")
        if p.name not in model or p.name in seen:
            what = "twice" if p.name in seen else "and this model has no such parameter"
            raise LimitExceeded(f"WeightsAvailable(version={a.version}).params[{i}] names {p.name!r} {what}")
        seen.add(p.name)
    if a.transport == "collective":
        _check_buckets(a, model)


def _check_buckets(a: WeightsAvailable, model: Shapes) -> None:
    what = f"WeightsAvailable(version={a.version})"
    for i, p in enumerate(a.params):
        if tuple(p.shape) != tuple(model[p.name]):
            raise LimitExceeded(f"{what}.params[{i}] ({p.name}) has shape {tuple(p.shape)}, this model's is "
                                f"{tuple(model[p.name])}")
    if a.bucket_bytes < 1:
        raise LimitExceeded(f"{what}.bucket_bytes = {a.bucket_bytes}, expected a positive size with transport "
                            "'collective'")
    try:
        total = WeightsLayout.of(a.params, a.dtype).total_bytes
    except ValueError as e:
        raise LimitExceeded(f"{what}: {e}") from None
    check_at_most(f"{what}.len(bucket_checksums)", len(a.bucket_checksums), MAX_BUCKETS, "protocol limit")
    buckets = -(-total // a.bucket_bytes)  # ceil
    if len(a.bucket_checksums) != buckets:
        raise LimitExceeded(f"{what}.len(bucket_checksums) = {len(a.bucket_checksums)}, expected {buckets} "
                            f"({total} bytes in buckets of {a.bucket_bytes})")


@dataclass
class WeightsFetch:
    """A policy version being fetched: chunks arrive in order (``WeightsChunk.index`` 0, 1, …)."""

    version: int
    num_chunks: int
    names: frozenset[str] | None
    """The announced parameter names (``WeightsAvailable.params``); ``None``: not checked."""
    model: Shapes | None = None
    """The receiver's parameter shapes: each tensor is checked against them as it arrives (``None``: not checked)."""
    next_index: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def announced(cls, a: WeightsAvailable, model: Shapes | None = None) -> WeightsFetch:
        """The fetch of the version ``a`` announces (bounded first with :func:`check_announcement`),
        into a model of parameter shapes ``model``."""
        return cls(a.version, a.num_chunks, frozenset(p.name for p in a.params), model)

    @property
    def complete(self) -> bool:
        return self.next_index >= self.num_chunks

    def finish(self) -> None:
        """The whole version arrived another way (over a weights group): no chunk is expected."""
        self.next_index = self.num_chunks

    def add(self, msg: WeightsChunk, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Add chunk ``msg`` (of this version) with its tensors.

        Returns:
            Every tensor of the version once its last chunk arrived, else ``None``.

        Raises:
            FetchAbandoned: the chunk is out of order, or of another chunk count; it repeats a
                tensor, holds one that was not announced or one of another shape than the model's;
                or the complete version's tensors differ from the announced names.
        """
        assert msg.version == self.version and not self.complete, "a chunk of another transfer"
        if msg.index != self.next_index or msg.num_chunks != self.num_chunks:
            raise FetchAbandoned(f"weights chunk {msg.index}/{msg.num_chunks} of version {msg.version}; "
                                 f"expected chunk {self.next_index}/{self.num_chunks}")
        dup = self.tensors.keys() & tensors.keys()
        if dup:
            raise FetchAbandoned(f"version {msg.version} sends tensors {sorted(dup)[:3]} twice")
        for name, t in tensors.items():
            if self.names is not None and name not in self.names:
                raise FetchAbandoned(f"version {msg.version} sends tensor {name[:MAX_ID_CHARS]!r}, "
                                     "which was not announced")
            shape = self.model.get(name) if self.model is not None else None
            if shape is not None and tuple(t.shape) != shape:
                raise FetchAbandoned(f"version {msg.version}: {name} has shape {tuple(t.shape)}, "
                                     f"this model's is {shape}")
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
