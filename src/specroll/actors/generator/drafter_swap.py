"""A generator's learned drafter: which version it serves, and how a new one is checked and swapped in.

With ``speculative = "eagle"`` a generator drafts with an EAGLE head: one loaded from a file at
start (``drafter``, served as version 0) and/or the versions the drafter trainer publishes through
the trainer. A received version is checked before the step loop sees it — its checksum recomputed
over the received bytes must equal the published one, and the head must fit the target's
vocabulary, width and depth — and a refused one changes nothing: the generator keeps serving what
it served (no speculation, if nothing). An accepted version is swapped in between engine steps:
copied into the served head when the shape is unchanged (live requests keep their draft state),
else served by a new proposer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import msgspec
import torch

from specroll.actors.generator.rollout_stream import DraftCounter
from specroll.drafter.eagle import EagleProposer, head_cache_tokens
from specroll.drafter.eagle_config import DrafterError, EagleConfig
from specroll.drafter.eagle_files import head_checksum
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.attention import kv_bytes_per_page
from specroll.engine.engine import Engine
from specroll.protocol.messages import AckDrafter, DrafterWeights

log = logging.getLogger("specroll.generator")


def check_drafter_cache(kv_cache_gb: float, engine: Engine, head: EagleConfig) -> None:
    """``drafter.kv_cache_gb`` holds ``head``'s K/V for one request of ``engine``: its positions up to
    the context length ``engine.max_model_len`` (a prompt plus ``max_tokens``, capped by the context: a
    generator cannot know the longest prompt before it arrives, so the context bounds it, as it bounds
    the engine's own KV cache) plus the draft positions the head steps through past the last verified
    one: ``num_draft_tokens - 1`` for a chain, ``(depth - 1) · width`` rows for the largest of
    ``draft_trees``. Without it the head's K/V fills up and requests go undrafted, silently.

    Raises:
        DrafterError: naming ``drafter.kv_cache_gb``, its value and the least that holds one request.
    """
    page_size = engine.config.page_size
    extra = max([engine.config.num_draft_tokens - 1] + [(t.depth - 1) * t.width for t in engine.config.tree_shapes])
    holds = head_cache_tokens(head, kv_cache_gb, page_size, engine.dtype)
    need = engine.max_model_len + extra
    if holds >= need:
        return
    page_bytes = kv_bytes_per_page(head.as_model_config(), page_size, engine.dtype)
    least_gb = math.ceil(-(-need // page_size) * page_bytes / 2**30 * 1e6) / 1e6  # whole pages, rounded up
    raise DrafterError(
        f"drafter.kv_cache_gb={kv_cache_gb:g} holds the drafter's K/V for {holds} positions, fewer than one "
        f"request needs: {engine.max_model_len} tokens (the context, generator.engine.max_model_len) + {extra} "
        f"draft positions = {need}; expected drafter.kv_cache_gb >= {least_gb:g}, or a lower "
        f"generator.engine.max_model_len")


@dataclass
class ReadyDrafter:
    """A checked drafter version, queued for the step loop."""

    version: int
    checksum: str
    head: EagleHead


def check_drafter(msg: DrafterWeights, tensors: dict[str, torch.Tensor], engine: Engine) -> ReadyDrafter:
    """Build the head a :class:`DrafterWeights` carries, checked against its checksum and the target.

    Raises:
        DrafterError: a checksum mismatch, a malformed config or tensors, or a head made for another
            target (vocabulary, hidden size, depth); the message names the version and the values.
    """
    source = f"drafter version {msg.version}"
    got = head_checksum(tensors)
    if got != msg.checksum:
        raise DrafterError(f"{source}: checksum of the received tensors {got[:16]}... differs from the published "
                           f"{msg.checksum[:16]}...")
    try:
        config = msgspec.json.decode(msg.config, type=EagleConfig)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise DrafterError(f"{source}: malformed config ({exc})") from None
    config.check_target(engine.model_config, source)  # before the config sizes anything
    head = EagleHead.from_tensors(config, tensors, source)  # the received shapes must be the config's
    return ReadyDrafter(msg.version, got, head)


class DrafterSlot:
    """The drafter a generator's engine serves, and its version (module docstring).

    Args:
        engine: the generator's engine; only the step loop calls :meth:`apply`.
        counter: the engine's proposer (a :class:`DraftCounter`), or ``None`` before any drafter.
        kv_cache_memory_gb: memory for a new proposer's head K/V.
        seed: draft-sampling seed of a new proposer.
    """

    def __init__(self, engine: Engine, counter: DraftCounter | None, kv_cache_memory_gb: float = 0.25,
                 seed: int = 0) -> None:
        self.engine = engine
        self.counter = counter
        self.version = 0
        """Drafter version served (0: a drafter loaded at start, or none)."""
        self.checksum = ""
        self.kv_cache_memory_gb = kv_cache_memory_gb
        self.seed = seed

    def apply(self, ready: ReadyDrafter) -> DraftCounter:
        """Serve ``ready`` from the next step on; returns the (possibly new) draft counter.

        Raises:
            DrafterError: the engine refused it, or a new shape whose K/V ``kv_cache_memory_gb`` cannot
                hold for one request (:func:`check_drafter_cache`); nothing changed then.
        """
        inner = self.counter.inner if self.counter is not None else None
        if isinstance(inner, EagleProposer) and inner.head.config == ready.head.config:
            inner.load_head(ready.head)
        else:
            check_drafter_cache(self.kv_cache_memory_gb, self.engine, ready.head.config)
            proposer = EagleProposer(ready.head, sample_drafts=True, kv_cache_memory_gb=self.kv_cache_memory_gb,
                                     page_size=self.engine.config.page_size, seed=self.seed)
            counter = DraftCounter(proposer)
            self.engine.set_proposer(counter)
            self.counter = counter
        self.version, self.checksum = ready.version, ready.checksum
        assert self.counter is not None
        return self.counter

    def swap(self, ready: ReadyDrafter) -> AckDrafter:
        """:meth:`apply` ``ready`` and return the acknowledgement for the trainer (with the refusal,
        when the engine refused it and nothing changed)."""
        try:
            self.apply(ready)
        except (DrafterError, ValueError) as e:
            log.error("drafter version %d refused by the engine: %s; still serving drafter version %d",
                      ready.version, e, self.version)
            return AckDrafter(version=ready.version, checksum=ready.checksum, refused=str(e)[:500])
        log.info("serving drafter version %d (checksum %s...)", ready.version, ready.checksum[:12])
        return AckDrafter(version=ready.version, checksum=ready.checksum)
