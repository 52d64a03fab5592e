"""Wire messages between the trainer (which hosts the rollout coordinator) and the generators.

Every message is a frozen msgspec ``Struct`` tagged by its ``type`` field; the messages that may
cross one direction of a channel form one tagged union, and a peer decodes with its inbound union
only, so a message sent the wrong way is refused at decode.

The trainer is the hub: generators and the drafter trainer both connect to its ROUTER. Drafter
versions travel drafter trainer → trainer (:class:`PublishDrafter`) → generators
(:class:`DrafterAvailable`, :class:`FetchDrafter`, :class:`DrafterWeights`, :class:`AckDrafter`), so a
generator needs one connection and an embedding client relays drafters the same way.

Channel trainer ↔ generator (the trainer's ROUTER binds, each generator's DEALER connects):

============================  ===================  =============================================
message                       direction            purpose
============================  ===================  =============================================
:class:`Hello`                generator → trainer  handshake: protocol version, role, capabilities
:class:`Welcome`              trainer → generator  handshake accepted
:class:`Refuse`               trainer → generator  handshake refused, with the reason
:class:`SubmitGroup`          trainer → generator  generate n samples of one prompt (or resume them)
:class:`Abort`                trainer → generator  stop a group; its samples finish with "abort"
:class:`RolloutChunk`         generator → trainer  new tokens of one sample (a delta)
:class:`WeightsAvailable`     trainer → generator  a new policy version can be fetched
:class:`FetchWeights`         generator → trainer  send me that version
:class:`WeightsChunk`         trainer → generator  some of its tensors, as frames after the header
:class:`AckWeights`           generator → trainer  the version is now served
:class:`JoinWeightsGroup`     generator → trainer  open a weights group with me (``collective``)
:class:`WeightsGroup`         trainer → generator  join that torch.distributed group as rank 1
:class:`WeightsBroadcast`     trainer → generator  the version's buckets are broadcast now
:class:`Heartbeat`            generator → trainer  liveness, live batch size, free capacity
:class:`Stats`                generator → trainer  counters for the progress display and metrics
:class:`ResetPrefixCache`     trainer → generator  forget the prefix cache between two steps
:class:`AckResetPrefixCache`  generator → trainer  the prefix cache is forgotten
:class:`Credit`               both                 flow control (see ``protocol/channel.py``)
:class:`Error`                both                 a message was refused, and why
:class:`Dead`                 both                 the sender is exiting (sent with a short linger)
:class:`DrafterAvailable`     trainer → generator  a new drafter version can be fetched
:class:`FetchDrafter`         generator → trainer  send me that drafter version
:class:`DrafterWeights`       trainer → generator  the whole drafter version, tensors as frames
:class:`AckDrafter`           generator → trainer  the drafter version is served (or refused)
============================  ===================  =============================================

Channel trainer ↔ drafter trainer (the drafter trainer's DEALER connects to the same ROUTER; it
says ``Hello(role="drafter")``, fetches policy weights as a generator does, and sends
``Heartbeat``, ``Credit``, ``Error``, ``Dead`` as a generator does):

============================  ===================  =============================================
:class:`FinishedRollouts`     trainer → drafter    token ids of finished rollouts to learn from
:class:`Capacity`             trainer → drafter    the generators' live load; pause or go on
:class:`PublishDrafter`       drafter → trainer    a new drafter version, tensors as frames
============================  ===================  =============================================

The weights and drafter channels' structs are in ``weights_messages.py`` and ``drafter_messages.py``,
the struct bases and shared field types in ``wire.py``; every name is importable from here.

Compatibility: fields are added only at the end, with defaults, and every change bumps
:data:`PROTOCOL_VERSION`. Peers exchange it in :class:`Hello` and refuse a mismatch, so the other
messages forbid unknown fields; the handshake messages accept them (and keep ``role`` a plain
string) so that a peer of another version still decodes them and gets a clear :class:`Refuse`.
"""

from __future__ import annotations

from specroll.protocol.drafter_messages import (
    AckDrafter,
    Capacity,
    DrafterAvailable,
    DrafterWeights,
    FetchDrafter,
    FinishedRollouts,
    PublishDrafter,
    RolloutTokens,
)
from specroll.protocol.sampling import SamplingParams
from specroll.protocol.weights_messages import (
    AckWeights,
    CollectiveBackend,
    FetchWeights,
    JoinWeightsGroup,
    TensorRef,
    TensorSpec,
    WeightsAvailable,
    WeightsBroadcast,
    WeightsChunk,
    WeightsGroup,
    WeightsTransport,
)
from specroll.protocol.wire import (
    ErrorCode,
    FinishReason,
    Logprobs,
    NonNegative,
    Positive,
    TokenIds,
    Versions,
    WireDtype,
    WireMessage,
    WireStruct,
)

PROTOCOL_VERSION = 4
"""Bumped on every change to a message; peers of different versions refuse each other."""

# ---- handshake --------------------------------------------------------------------------------


class Hello(WireMessage, tag="hello", forbid_unknown_fields=False):
    """First message of a connecting actor. The receiver answers :class:`Welcome` or :class:`Refuse`."""

    protocol_version: int
    """The sender's :data:`PROTOCOL_VERSION`."""
    role: str
    """``"generator"``, ``"drafter"`` or ``"client"`` (a string so any version decodes it)."""
    actor_id: str
    """Unique per process incarnation (e.g. ``"generator-0-<uuid4 hex>"``); also its ZeroMQ identity."""
    capabilities: tuple[str, ...] = ()
    """Optional features, e.g. ``"speculative"``, ``"resume"``, ``"bf16-weights"``."""


class Welcome(WireMessage, tag="welcome", forbid_unknown_fields=False):
    """The handshake succeeded."""

    protocol_version: int
    actor_id: str
    """The accepting actor's id."""
    capabilities: tuple[str, ...] = ()


class Refuse(WireMessage, tag="refuse", forbid_unknown_fields=False):
    """The handshake failed; the refused actor should exit with ``reason``."""

    reason: str
    """Human-readable, naming the bad value and what was expected (e.g. both protocol versions)."""
    protocol_version: int = PROTOCOL_VERSION
    """The refusing side's version."""


# ---- rollouts ---------------------------------------------------------------------------------


class SampleResume(WireStruct):
    """The response tokens one sample already has: a group continues on another generator from here."""

    index: NonNegative
    """Sample index within the group, in ``[0, n)``."""
    token_ids: TokenIds
    """Response token ids streamed so far (never re-tokenized text)."""
    logprobs: Logprobs
    """Behavior logprob (natural log) of each token."""
    versions: Versions
    """Policy version that produced each token."""

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"sample {self.index}: {len(self.token_ids)} token ids, {len(self.logprobs)} logprobs and "
                f"{len(self.versions)} versions; expected equal lengths"
            )


class SubmitGroup(WireMessage, tag="submit_group"):
    """Generate ``n`` samples of one prompt (a GRPO group), streaming :class:`RolloutChunk` deltas.

    With ``resume`` non-empty the group continues elsewhere after a generator died: exactly the
    listed samples are generated, each after its tokens (which the trainer already has, so chunks
    continue at ``offset = len(token_ids)``); the samples not listed had finished. ``max_tokens``
    bounds the whole response, resumed tokens included.
    """

    group_id: str
    prompt_token_ids: TokenIds
    n: Positive
    sampling: SamplingParams
    resume: tuple[SampleResume, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"group {self.group_id!r}: empty prompt_token_ids")
        if self.n < 1:
            raise ValueError(f"group {self.group_id!r}: n={self.n}, expected >= 1")
        indices = [r.index for r in self.resume]
        if len(set(indices)) != len(indices) or any(not 0 <= i < self.n for i in indices):
            raise ValueError(
                f"group {self.group_id!r}: resume indices {indices}, expected distinct values in [0, {self.n})"
            )


class SpecStats(WireStruct):
    """Speculative-decoding counters for the steps a chunk covers (acceptance length =
    ``1 + num_accepted / num_draft_steps``)."""

    num_drafted: NonNegative = 0
    """Draft tokens verified."""
    num_accepted: NonNegative = 0
    """Draft tokens accepted."""
    num_draft_steps: NonNegative = 0
    """Steps that verified at least one draft."""
    drafter_version: NonNegative = 0
    """The drafter version that proposed these drafts (0: a model-free or locally loaded drafter).
    A generator sends the chunks of every live sample before it swaps drafters, so one chunk's
    drafts all come from one version."""


class RolloutChunk(WireMessage, tag="rollout_chunk"):
    """New tokens of one sample: a delta, never the whole sequence.

    ``token_ids``, ``logprobs`` and ``versions`` are aligned: token i was sampled with behavior
    logprob ``logprobs[i]`` (natural log, under the processed distribution) by the weights of policy
    version ``versions[i]``. A sample's chunks arrive in order; the last has ``finished=True``.
    """

    group_id: str
    sample_index: NonNegative
    offset: NonNegative
    """Sequence position: response tokens of this sample before this chunk's first token. It is
    the same on any generator, so the trainer checks it against what it holds (no gap, no
    duplicate) also after a group resumed elsewhere."""
    token_ids: TokenIds
    logprobs: Logprobs
    versions: Versions
    finished: bool = False
    finish_reason: FinishReason | None = None
    """Set exactly when ``finished``."""
    spec: SpecStats | None = None

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"chunk {self.group_id!r}/{self.sample_index}: {len(self.token_ids)} token ids, "
                f"{len(self.logprobs)} logprobs and {len(self.versions)} versions; expected equal lengths"
            )
        if self.finished != (self.finish_reason is not None):
            raise ValueError(
                f"chunk {self.group_id!r}/{self.sample_index}: finished={self.finished} with "
                f"finish_reason={self.finish_reason!r}; a reason is given exactly when finished"
            )


class Abort(WireMessage, tag="abort"):
    """Stop a group now; each unfinished sample sends a last chunk with finish reason ``"abort"``."""

    group_id: str


# ---- liveness, stats, control -----------------------------------------------------------------


class Heartbeat(WireMessage, tag="heartbeat"):
    """Sent every heartbeat interval; its absence for a timeout marks the generator dead."""

    policy_version: int
    """Policy version served now."""
    batch_size: NonNegative
    """Sequences decoding in the live batch."""
    free_groups: NonNegative
    """How many more groups it can take now."""
    free_seqs: NonNegative
    """How many more sequences (samples) it can take now."""


class Stats(WireMessage, tag="stats"):
    """Cumulative generator counters since it started (the trainer takes differences)."""

    policy_version: int
    num_steps: NonNegative
    """Engine steps run."""
    num_tokens: NonNegative
    """Response tokens emitted."""
    busy_s: float
    """Seconds spent in engine steps."""
    idle_s: float
    """Seconds with nothing to decode."""
    spec: SpecStats | None = None
    drafter_version: NonNegative = 0
    """Drafter version served now (0: none received)."""
    prompt_tokens: NonNegative = 0
    """Prompt tokens the engine admitted, each request once (the engine's ``PrefixCacheCounters``)."""
    cached_prompt_tokens: NonNegative = 0
    """Of those, tokens whose K/V came from the prefix cache instead of being computed."""


class ResetPrefixCache(WireMessage, tag="reset_prefix_cache"):
    """Forget every prefix-cache entry between two engine steps (``BlockManager.forget_cached``):
    live requests keep their K/V, later ones share nothing cached before. Answered with
    :class:`AckResetPrefixCache` carrying the same ``request_id``."""

    request_id: NonNegative
    """Chosen by the trainer; echoed in the acknowledgement."""


class AckResetPrefixCache(WireMessage, tag="ack_reset_prefix_cache"):
    """The generator forgot its prefix cache as :class:`ResetPrefixCache` ``request_id`` asked."""

    request_id: NonNegative


class Credit(WireMessage, tag="credit"):
    """Flow control: the receiver lets its peer send messages with sequence numbers below ``limit``.

    Cumulative (the largest limit wins), so a lost or late grant is healed by the next one.
    """

    limit: NonNegative


class Error(WireMessage, tag="error"):
    """A message was refused; ``seq`` is its sequence number when it could be read."""

    code: ErrorCode
    message: str
    """Names the bad value and what was expected."""
    seq: int | None = None
    group_id: str | None = None
    """The group of a refused ``SubmitGroup`` (None for other messages): the hub ends a served
    request's group at once rather than wait for it."""


class Dead(WireMessage, tag="dead"):
    """The sender is exiting; its peer stops routing work to it at once (no heartbeat timeout)."""

    actor_id: str
    reason: str = ""


ToTrainer = (Hello | RolloutChunk | FetchWeights | AckWeights | Heartbeat | Stats | Credit | Error | Dead
             | FetchDrafter | AckDrafter | PublishDrafter | JoinWeightsGroup | AckResetPrefixCache)
"""What a trainer (coordinator) receives from a generator or the drafter trainer."""
ToGenerator = (Welcome | Refuse | SubmitGroup | Abort | WeightsAvailable | WeightsChunk | Credit | Error | Dead
               | DrafterAvailable | DrafterWeights | WeightsGroup | WeightsBroadcast | ResetPrefixCache)
"""What a generator receives from the trainer."""
ToDrafter = (Welcome | Refuse | WeightsAvailable | WeightsChunk | FinishedRollouts | Capacity | Credit | Error
             | Dead | DrafterAvailable)
"""What the drafter trainer receives from the trainer."""

CONTROL_MESSAGES: tuple[type, ...] = (Credit, Heartbeat, Dead)
"""Not numbered and sent without waiting for credit (``protocol/channel.py``): flow control itself,
liveness and the last word must never be stuck behind data. Their rate is bounded by time, not by
work, so they cannot flood a peer."""

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "AckDrafter",
    "AckResetPrefixCache",
    "AckWeights",
    "Capacity",
    "CollectiveBackend",
    "Credit",
    "Dead",
    "DrafterAvailable",
    "DrafterWeights",
    "Error",
    "ErrorCode",
    "FetchDrafter",
    "FetchWeights",
    "FinishReason",
    "FinishedRollouts",
    "Heartbeat",
    "Hello",
    "JoinWeightsGroup",
    "NonNegative",
    "PublishDrafter",
    "Refuse",
    "ResetPrefixCache",
    "RolloutChunk",
    "RolloutTokens",
    "SampleResume",
    "SpecStats",
    "Stats",
    "SubmitGroup",
    "TensorRef",
    "TensorSpec",
    "ToDrafter",
    "ToGenerator",
    "ToTrainer",
    "WeightsAvailable",
    "WeightsBroadcast",
    "WeightsChunk",
    "WeightsGroup",
    "WeightsTransport",
    "Welcome",
    "WireDtype",
    "WireMessage",
    "WireStruct",
]
