"""Upper bounds on what a peer may ask for: every count and size a message carries is checked
against one before any work is done for it, and a message over a bound is answered with an
``Error`` (code ``bad_request``) naming the field, its value and the limit.

Most bounds come from the receiver's own configuration and are checked where it is known (a
generator's ``max_num_seqs``, its model's context, vocabulary and parameter shapes:
``actors/generator/submit_limits.py``, ``actors/peer/weights_fetch.py``; the trainer's vocabulary
for the token ids generators stream back, with :func:`check_token_ids`:
``actors/rollout/receive.py``). The few here hold for every receiver; each is far above
what a legitimate peer sends, so none ever refuses real work.
The codec already bounds a message as a whole (``codec.MAX_HEADER_BYTES``); these bound what a
handler would build from it (a per-sample loop, a per-character copy).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_ID_CHARS = 256
"""Characters of a group id, a tensor name or a checksum. The trainer names groups ``g<number>``
and a checksum is 64 hex digits; an id is copied into every sample's request id and log line, so
a megabyte id would cost a megabyte per sample."""

MAX_GROUP_SIZE = 1 << 16
"""Samples of one group (``SubmitGroup.n``, ``FinishedRollouts.rollouts``), whatever the receiver:
GRPO groups are 2–64 samples; a generator further bounds the samples it starts by its own
``max_num_seqs``."""

MAX_VERSION = 1 << 62
"""A drafter version a peer may announce or publish: the drafter trainer numbers its next version
above the largest it saw, which must still fit the wire's 64-bit integers."""

MAX_SEQS = 1 << 32
"""Sequences a generator may report decoding or free (``Heartbeat.batch_size``, ``free_seqs``,
``free_groups``): far above any engine's batch, and low enough that the trainer's sums over its
generators stay within the wire's 64-bit integers (``Capacity``)."""

MAX_SEQUENCE_TOKENS = 1 << 20
"""Tokens of one sequence any message may carry (a prompt, a response, a resumed sample, a chunk):
above every context a served model has (1M tokens at the long end). Declared on the wire types, so
msgspec refuses a longer list from its length prefix, before one element is decoded."""

DEFAULT_MAX_FRAME_BYTES = 1 << 31
"""The largest frame a receiver that does not know the model accepts (``ZMQ_MAXMSGSIZE``): a
float32 embedding of a 128k vocabulary at hidden size 4096. Receivers that know the model size it
from the model (:func:`frame_limit`)."""

MAX_STOP_TOKEN_IDS = 1024
"""``SamplingParams.stop_token_ids`` of one group: every emitted token is looked up in it."""

MAX_DRAFTER_TENSORS = 256
"""Tensors of one drafter version: an EAGLE head has about a dozen (``drafter/eagle_head.py``)."""

MAX_DRAFTER_CONFIG_CHARS = 1 << 16
"""Characters of a drafter version's JSON config (an ``EagleConfig`` is a few hundred)."""


class LimitExceeded(ValueError):
    """A count or size in a message is over its bound; the message names the field, the value and
    the limit (with why), ready to go back as an ``Error``."""


def check_at_most(field: str, value: int, limit: int, why: str) -> None:
    """Raise :class:`LimitExceeded` unless ``value <= limit``.

    Args:
        field: the message field, as a reader of the message would name it (``"n"``,
            ``"len(prompt_token_ids)"``).
        value: the count or size the peer sent.
        limit: the largest value accepted.
        why: where the limit comes from (``"generator.engine.max_num_seqs"``).
    """
    if value > limit:
        raise LimitExceeded(f"{field} = {value} is over the limit {limit} ({why})")


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    """Raise :class:`LimitExceeded` unless every id is in the vocabulary ``[0, vocab_size)``.

    Work: one pass over ``ids`` (``min`` and ``max``); a second, to name the first bad id, only
    when one is there.

    Args:
        field: the message field holding the ids (``"RolloutChunk.token_ids"``); the error names
            ``field[i]``.
        ids: the token ids the peer sent.
        vocab_size: the receiver's model's vocabulary size.
    """
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise LimitExceeded(f"{field}[{i}] = {t} is outside the model's vocabulary [0, {vocab_size})")


def frame_limit(max_header_bytes: int, max_tensor_bytes: int) -> int:
    """``ZMQ_MAXMSGSIZE`` for a receiver: the largest frame a legitimate peer sends it — its header
    limit, or its largest tensor frame. libzmq reads a frame's length before its body and drops a
    connection whose frame is longer, so no memory is spent on it (the peer reconnects; what it sent
    after is then a sequence gap, handled as any lost message)."""
    return max(max_header_bytes, max_tensor_bytes)
