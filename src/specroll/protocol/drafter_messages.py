"""The drafter channel: finished rollouts and the generators' load to the drafter trainer, drafter
versions from it to the generators through the trainer (see ``messages.py`` for the table)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from specroll.protocol.weights_messages import TensorRef
from specroll.protocol.wire import NonNegative, Positive, TokenIds, WireMessage, WireStruct


class RolloutTokens(WireStruct):
    """One finished rollout as the drafter trainer needs it: token ids only."""

    prompt_token_ids: TokenIds
    token_ids: TokenIds
    """Response token ids."""
    policy_version: int
    """The newest policy version among its tokens."""


class FinishedRollouts(WireMessage, tag="finished_rollouts"):
    """Rollouts of groups that just finished (the drafter trainer's training data)."""

    rollouts: list[RolloutTokens]


class Capacity(WireMessage, tag="capacity"):
    """The generators' load, sent to the drafter trainer about twice a second: it trains when
    there is idle capacity (the tail phase) and stops between its steps when ``pause``."""

    live_seqs: NonNegative
    """Sequences decoding in all generators' live batches (their last heartbeats)."""
    max_seqs: NonNegative
    """Sequences all generators could decode at once."""
    pause: bool = False
    """Stop training until a ``Capacity`` without it (e.g. the trainer's own step needs the cores)."""


class PublishDrafter(WireMessage, tag="publish_drafter"):
    """A new drafter version; ``tensors`` point at the frames after the header (float32 weights,
    the int64 ``draft_to_target``)."""

    version: Positive
    """Drafter version: 1, 2, ... per drafter trainer incarnation, above every earlier one."""
    policy_version: int
    """The policy version it was trained against."""
    config: str
    """The head's config as JSON (``EagleConfig``, the drafter directory's ``config.json``)."""
    checksum: str
    """SHA-256 of the tensors (``specroll.drafter.eagle_files.head_checksum``)."""
    tensors: tuple[TensorRef, ...]
    train_steps: NonNegative = 0
    """Optimizer steps the drafter trainer had taken."""
    train_s: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0
    """Seconds the drafter trainer had spent in those steps (its measured share of idle capacity)."""


class DrafterAvailable(WireMessage, tag="drafter_available"):
    """Drafter ``version`` is published; a generator that speculates with a learned drafter
    fetches it with :class:`FetchDrafter`. A drafter trainer gets it too (when it joins, after
    publishing a version that was not above it, when another one publishes): its next version
    is numbered above it."""

    version: Positive
    policy_version: int
    checksum: str


class FetchDrafter(WireMessage, tag="fetch_drafter"):
    """Send me drafter version ``version`` (answered by one :class:`DrafterWeights`)."""

    version: Positive


class DrafterWeights(WireMessage, tag="drafter_weights"):
    """A whole drafter version (a few MB: one message); applied between steps."""

    version: Positive
    policy_version: int
    config: str
    checksum: str
    tensors: tuple[TensorRef, ...]


class AckDrafter(WireMessage, tag="ack_drafter"):
    """The generator now serves drafter ``version`` and computed ``checksum`` over what it received;
    with ``refused`` set it did not load it (and says why) and keeps what it served before."""

    version: Positive
    checksum: str
    refused: str = ""
