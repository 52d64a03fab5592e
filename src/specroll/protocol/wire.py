"""What every wire message is built from: the struct bases (frozen, strict, tagged) and the
field types shared across channels."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from specroll.protocol.limits import MAX_SEQUENCE_TOKENS

WireDtype = Literal["float32", "bfloat16", "float16", "int64", "int32", "uint8", "bool"]
"""Tensor element types that may travel (torch names)."""
FinishReason = Literal["stop", "length", "abort"]
"""Why a request stopped: ``stop`` (end of sequence or a stop token), ``length`` (its max_tokens or
the context), ``abort``. The engine reports the same values (one definition, here)."""
ErrorCode = Literal["malformed", "sequence", "unknown_peer", "unknown_group", "bad_request", "internal"]
"""``malformed``: undecodable frames; ``sequence``: a gap or duplicate; ``unknown_peer``: no
handshake yet; ``unknown_group``: abort/chunk for a group not known; ``bad_request``: decodable but
not acceptable now (e.g. a weight version never published); ``internal``: the peer's own failure."""

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
TokenIds = Annotated[list[int], msgspec.Meta(max_length=MAX_SEQUENCE_TOKENS)]
"""Token ids of one sequence; a longer list is refused from its length prefix, before decoding."""
Logprobs = Annotated[list[float], msgspec.Meta(max_length=MAX_SEQUENCE_TOKENS)]
"""A behavior logprob per token (natural log)."""
Versions = Annotated[list[int], msgspec.Meta(max_length=MAX_SEQUENCE_TOKENS)]
"""The policy version of each token."""


class WireStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True, gc=False):
    """Plain nested struct. ``gc=False``: messages hold only scalars, lists and structs, never cycles."""


class WireMessage(WireStruct, tag_field="type"):
    """Base of every top-level message; the tag is the ``type`` field."""
