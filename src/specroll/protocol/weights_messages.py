"""The policy-weights channel: a new version announced, fetched and sent in chunks, acknowledged
(trainer ↔ generator and trainer ↔ drafter trainer; see ``messages.py`` for the table)."""

from __future__ import annotations

from specroll.protocol.wire import NonNegative, Positive, WireDtype, WireMessage, WireStruct


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


class FetchWeights(WireMessage, tag="fetch_weights"):
    """Send me version ``version`` (answered by its :class:`WeightsChunk` messages, in order)."""

    version: NonNegative


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
