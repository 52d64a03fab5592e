"""The policy-weights channel: a new version announced, fetched and sent in chunks, acknowledged
(trainer ↔ generator and trainer ↔ drafter trainer; see ``messages.py`` for the table).

With ``network.weights_transport = "collective"`` a generator may fetch the tensors over a
torch.distributed group of its own instead of chunks (``weights_collective.py``): it
asks for the group (:class:`JoinWeightsGroup` → :class:`WeightsGroup`), then fetches with
``FetchWeights(transport="collective")``, answered by :class:`WeightsBroadcast` and the broadcasts
of the version's bytes in buckets, each checked against ``WeightsAvailable.bucket_checksums``.
Control (announcement, request, acknowledgement) always travels here, over ZeroMQ.
"""

from __future__ import annotations

from typing import Literal

from specroll.protocol.wire import NonNegative, Positive, WireDtype, WireMessage, WireStruct

WeightsTransport = Literal["zmq", "collective"]
"""How a policy version's tensors travel: ``zmq`` (:class:`WeightsChunk` messages on this channel)
or ``collective`` (bucketed broadcasts over a torch.distributed group, NCCL or gloo)."""
CollectiveBackend = Literal["gloo", "nccl"]
"""The torch.distributed backend of a weights group: ``gloo`` (CPU tensors, TCP) or ``nccl`` (CUDA)."""
MAX_BUCKETS = 1 << 20
"""Buckets one version may be split into (``len(WeightsAvailable.bucket_checksums)``): a bucket is at
least 1 MiB (``network.weights_bucket_mb``), so this allows a terabyte of weights."""


class TensorRef(WireStruct):
    """Where a tensor of a message travels: frame ``frame`` (>= 1) holds its raw bytes, C order."""

    name: str
    dtype: WireDtype
    shape: tuple[NonNegative, ...]
    frame: Positive


class TensorSpec(WireStruct):
    """A tensor's name and shape, announced before it is sent."""

    name: str
    shape: tuple[NonNegative, ...]


class WeightsAvailable(WireMessage, tag="weights_available"):
    """Policy version ``version`` is published; a generator fetches it with :class:`FetchWeights`."""

    version: NonNegative
    dtype: WireDtype
    """Element type on the wire (``float32`` or ``bfloat16``); the generator casts to its own."""
    params: list[TensorSpec]
    """Hugging Face parameter names and shapes, in the order the chunks send them."""
    num_chunks: Positive
    transport: WeightsTransport = "zmq"
    """``collective``: the trainer also serves this version over weights groups (a generator in one
    fetches with ``FetchWeights(transport="collective")``); chunks are always served."""
    bucket_bytes: NonNegative = 0
    """With ``collective``: bytes per broadcast bucket. The version's tensors, cast to ``dtype`` and
    laid end to end in ``params`` order (C order each), form one byte string; bucket ``i`` is its
    bytes ``[i * bucket_bytes, (i + 1) * bucket_bytes)``, the last one shorter."""
    bucket_checksums: tuple[NonNegative, ...] = ()
    """With ``collective``: the CRC-32 (``zlib.crc32``) of each bucket's bytes, in order."""


class FetchWeights(WireMessage, tag="fetch_weights"):
    """Send me version ``version`` (answered by its :class:`WeightsChunk` messages, in order; with
    ``transport="collective"`` by :class:`WeightsBroadcast` and the broadcasts over the sender's
    weights group, or by the chunks when the trainer has no working group with it)."""

    version: NonNegative
    transport: WeightsTransport = "zmq"


class WeightsChunk(WireMessage, tag="weights_chunk"):
    """Chunk ``index`` of ``num_chunks`` of a policy version; ``tensors`` point at the frames after
    the header. Apply the version only once every chunk arrived (atomic update)."""

    version: NonNegative
    index: NonNegative
    num_chunks: Positive
    tensors: tuple[TensorRef, ...]

    def __post_init__(self) -> None:
        if self.index >= self.num_chunks:
            raise ValueError(f"weights chunk index {self.index}, expected < num_chunks={self.num_chunks}")


class AckWeights(WireMessage, tag="ack_weights"):
    """The generator now serves policy version ``version`` (tokens from its next step carry it)."""

    version: NonNegative


class JoinWeightsGroup(WireMessage, tag="join_weights_group"):
    """Open a weights group with me (generator → trainer); answered by :class:`WeightsGroup`.
    Sent once per trainer incarnation, after an announcement with ``transport="collective"``."""

    device: Literal["cpu", "cuda"]
    """Where the sender's engine keeps its weights: ``nccl`` needs ``cuda`` on both sides."""


class WeightsGroup(WireMessage, tag="weights_group"):
    """Join weights group ``name`` as rank 1 of 2 (the trainer is rank 0): connect to the
    ``torch.distributed.TCPStore`` at ``host:port`` and build a ``backend`` process group whose
    operations time out after ``timeout_s``. ``refused`` non-empty: no group (why); fetch chunks."""

    name: str
    host: str
    port: NonNegative
    backend: CollectiveBackend = "gloo"
    timeout_s: float = 60.0
    refused: str = ""


class WeightsBroadcast(WireMessage, tag="weights_broadcast"):
    """The answer to ``FetchWeights(version, transport="collective")``: the trainer now broadcasts
    version ``version``'s buckets over group ``group``, in order (receive them now)."""

    version: NonNegative
    group: str
