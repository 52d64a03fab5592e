"""Messages ↔ ZeroMQ frames. No pickle: a peer can make us allocate a checked amount of memory, never run code.

Frame layout of one message::

    frame 0      msgpack header: [session, seq, message]   (see :class:`Header`)
    frame 1..N   raw bytes of the tensors the message references, one tensor per frame, C order

A message that carries tensors lists them in a field ``tensors: tuple[TensorRef, ...]``; each
:class:`~specroll.protocol.messages.TensorRef` names its frame, dtype and shape. Tensor frames are
sent zero-copy (a ``memoryview`` of the CPU tensor's storage), and bfloat16 travels as its raw
2-byte words, since numpy has no bfloat16.

:func:`decode` validates everything a peer controls and raises only :class:`ProtocolError`.
Decoded tensors are **writable copies** (one ``memcpy`` per tensor from the received frame into a
fresh ``bytearray``): the receiver owns them and the ZeroMQ buffer can be released at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar

import msgspec
import torch

from specroll.protocol.messages import TensorRef

M = TypeVar("M")

MAX_HEADER_BYTES = 64 << 20
"""Default limit on frame 0 (a resumed group of long samples is a few MB; weights are frames)."""
MAX_NDIM = 32
MAX_DIM = 1 << 40

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtype allowlist: wire name → torch dtype."""
_WIRE_NAMES = {dt: name for name, dt in WIRE_DTYPES.items()}

Buffer = Any
"""Anything with the buffer protocol: bytes, bytearray, memoryview, ``zmq.Frame``."""


class ProtocolError(ValueError):
    """Frames that are not a valid message: the one error :func:`decode` raises.

    ``peer`` (the sender's ZeroMQ identity, when known) and ``seq`` (the offending message's
    sequence number, when it could be read) let the receiver answer with an
    :class:`~specroll.protocol.messages.Error`.
    """

    def __init__(self, message: str, *, peer: bytes | None = None, seq: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.seq = seq


class Header(msgspec.Struct, Generic[M], array_like=True, frozen=True, forbid_unknown_fields=True):
    """Frame 0: the sender's session id, its sequence number for this peer, and the message."""

    session: Annotated[int, msgspec.Meta(ge=0)]
    """Random per sending channel (process incarnation): a new one means the peer restarted."""
    seq: Annotated[int, msgspec.Meta(ge=0)]
    msg: M


@dataclass(frozen=True)
class Decoded(Generic[M]):
    """A decoded message with its header fields and tensors (name → writable CPU tensor)."""

    session: int
    seq: int
    msg: M
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


_encoder = msgspec.msgpack.Encoder()


@functools.cache
def _decoder(union: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(Header[union])  # type: ignore[valid-type]


def pack_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[tuple[TensorRef, ...], list[torch.Tensor]]:
    """Refs for a message's ``tensors`` field, and the tensors to pass to :func:`encode` (frames 1, 2, ...).

    Raises:
        ValueError: a dtype outside :data:`WIRE_DTYPES` or a duplicate name.
    """
    refs: list[TensorRef] = []
    tensors: list[torch.Tensor] = []
    for name, t in named:
        if t.dtype not in _WIRE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; expected one of {sorted(WIRE_DTYPES)}")
        if any(r.name == name for r in refs):
            raise ValueError(f"tensor name {name!r} appears twice")
        refs.append(TensorRef(name=name, dtype=_WIRE_NAMES[t.dtype], shape=tuple(t.shape), frame=len(refs) + 1))
        tensors.append(t)
    return tuple(refs), tensors


def _tensor_frame(ref: TensorRef, t: torch.Tensor) -> memoryview:
    if t.layout != torch.strided or t.dtype != WIRE_DTYPES[ref.dtype] or tuple(t.shape) != ref.shape:
        raise ValueError(
            f"tensor {ref.name!r} is {t.dtype} {tuple(t.shape)} ({t.layout}); its ref says {ref.dtype} {ref.shape}"
        )
    t = t.detach().cpu().contiguous()  # no-ops for a contiguous CPU tensor
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the bytes, no copy; keeps t alive


def encode(msg: Any, tensors: Sequence[torch.Tensor] = (), *, session: int = 0, seq: int = 0) -> list[Buffer]:
    """Frames of ``msg``: the header, then one frame per tensor of ``msg.tensors`` (in ref order).

    Tensor frames are views of the tensors' memory (CPU, contiguous; others are copied first):
    do not modify a tensor until ZeroMQ has sent it — publish a snapshot.

    Raises:
        ValueError: tensors that do not match ``msg.tensors`` (count, frame index, dtype, shape).
    """
    refs: tuple[TensorRef, ...] = getattr(msg, "tensors", ())
    if len(refs) != len(tensors):
        raise ValueError(f"{type(msg).__name__} references {len(refs)} tensors but {len(tensors)} were given")
    frames: list[Buffer] = [_encoder.encode(Header(session=session, seq=seq, msg=msg))]
    for i, (ref, t) in enumerate(zip(refs, tensors, strict=True), start=1):
        if ref.frame != i:
            raise ValueError(f"tensor {ref.name!r} refers to frame {ref.frame}; expected {i} (refs in frame order)")
        frames.append(_tensor_frame(ref, t))
    return frames


def _as_bytes(frame: Buffer, index: int) -> memoryview:
    try:
        return memoryview(frame).cast("B")
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"frame {index} is not a contiguous byte buffer ({type(frame).__name__}): {e}") from None


def _tensor(ref: TensorRef, buf: memoryview) -> torch.Tensor:
    if len(ref.shape) > MAX_NDIM or any(d > MAX_DIM for d in ref.shape):
        raise ProtocolError(f"tensor {ref.name!r} has shape {ref.shape}; expected at most {MAX_NDIM} dims of <= 2**40")
    dtype = WIRE_DTYPES[ref.dtype]
    expected = math.prod(ref.shape) * dtype.itemsize
    if buf.nbytes != expected:
        raise ProtocolError(
            f"tensor {ref.name!r} ({ref.dtype} {ref.shape}) needs {expected} bytes; frame {ref.frame} has {buf.nbytes}"
        )
    if expected == 0:
        return torch.empty(ref.shape, dtype=dtype)
    t = torch.frombuffer(bytearray(buf), dtype=dtype)  # the one copy: writable, owned by the tensor
    if dtype == torch.bool and int(t.view(torch.uint8).max()) > 1:
        raise ProtocolError(f"tensor {ref.name!r} is bool but frame {ref.frame} holds bytes other than 0 and 1")
    return t.reshape(ref.shape)


def decode(frames: Sequence[Buffer], union: Any, *, max_header_bytes: int = MAX_HEADER_BYTES) -> Decoded[Any]:
    """Decode and validate one message of the tagged union ``union`` and its tensor frames.

    Checks: at least one frame; header size; msgpack well-formed; a known tag, every field's type
    and range, and the message's own invariants; every tensor ref has an allowed dtype, a frame
    index in range, a shape whose bytes match the frame; every extra frame is referenced once.

    Raises:
        ProtocolError: naming the problem; ``.seq`` is set when the header could be read.
    """
    if not isinstance(frames, Sequence) or len(frames) == 0:
        raise ProtocolError(f"expected a non-empty sequence of frames, got {type(frames).__name__} {frames!r:.80}")
    head = _as_bytes(frames[0], 0)
    if head.nbytes > max_header_bytes:
        raise ProtocolError(f"header frame has {head.nbytes} bytes; the limit is {max_header_bytes}")
    try:
        header = _decoder(union).decode(head)
    except msgspec.DecodeError as e:  # ValidationError (types, tags, invariants) is a subclass
        raise ProtocolError(f"bad header: {e}") from None
    except RecursionError:
        raise ProtocolError("bad header: msgpack nested too deeply") from None
    msg = header.msg
    refs: tuple[TensorRef, ...] = getattr(msg, "tensors", ())
    name = type(msg).__name__
    if len(frames) != len(refs) + 1:
        raise ProtocolError(
            f"{name} (seq {header.seq}) references {len(refs)} tensors but came with {len(frames) - 1} tensor frames",
            seq=header.seq,
        )
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for ref in refs:
        if not 1 <= ref.frame < len(frames) or ref.frame in seen:
            raise ProtocolError(
                f"{name} tensor {ref.name!r} refers to frame {ref.frame}; "
                f"expected an unused frame in 1..{len(frames) - 1}",
                seq=header.seq,
            )
        if ref.name in tensors:
            raise ProtocolError(f"{name} names tensor {ref.name!r} twice", seq=header.seq)
        seen.add(ref.frame)
        try:
            tensors[ref.name] = _tensor(ref, _as_bytes(frames[ref.frame], ref.frame))
        except ProtocolError as e:
            raise ProtocolError(f"{name}: {e}", seq=header.seq) from None
    return Decoded(session=header.session, seq=header.seq, msg=msg, tensors=tensors)
