"""The trainer side of online drafter training: drafter trainers, drafter versions, acceptance.

:class:`DrafterRelay` is the part of :class:`~specroll.actors.rollout.client.RolloutClient` that serves
drafter trainers (peers that said ``Hello(role="drafter")``) and relays their drafter versions to
the generators; the client calls it from its receive loop and its tick, and it sends through the
client's per-peer outboxes, so a slow drafter trainer holds up only its own messages.

* finished groups go to every drafter trainer as :class:`FinishedRollouts` (token ids only);
* about twice a second each drafter trainer gets :class:`Capacity`: the generators' live batch
  from their last heartbeats, and ``pause`` while :meth:`DrafterRelay.pause` is in force;
* a :class:`PublishDrafter` is kept as the current drafter version (versions only increase) and
  announced to every generator (:class:`DrafterAvailable`); a generator fetches it
  (:class:`FetchDrafter` → :class:`DrafterWeights`) and acknowledges (:class:`AckDrafter`) with the
  checksum it computed, which must equal the published one;
* every chunk's :class:`SpecStats` is summed per (drafter version, policy version):
  :meth:`DrafterRelay.acceptance` is the acceptance length of each pair.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specroll.actors.rollout.outboxes import Send
from specroll.actors.rollout.timeline import Timeline
from specroll.protocol.limits import (
    MAX_DRAFTER_CONFIG_CHARS,
    MAX_DRAFTER_TENSORS,
    MAX_ID_CHARS,
    MAX_VERSION,
    LimitExceeded,
    check_at_most,
)
from specroll.protocol.messages import (
    AckDrafter,
    Capacity,
    DrafterAvailable,
    DrafterWeights,
    Error,
    FetchDrafter,
    FinishedRollouts,
    PublishDrafter,
    RolloutChunk,
    RolloutTokens,
)
from specroll.rl.coordinator import Group

log = logging.getLogger("specroll.client")


@dataclass
class AcceptanceCounts:
    """Speculative counters of the chunks of one (drafter version, policy version) pair."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_draft_steps: int = 0

    @property
    def acceptance_length(self) -> float | None:
        """Tokens emitted per verify step: ``1 + accepted / draft steps`` (None before any)."""
        return 1.0 + self.num_accepted / self.num_draft_steps if self.num_draft_steps else None


class DrafterRelay:
    """Drafter trainers and drafter versions for one client (module docstring).

    Args:
        send: queues a message (and tensors) for a peer.
        timeline: records ``drafter_published`` when a version becomes current and ``drafter_served``
            when a generator acknowledges one it swapped in (None: nothing recorded).
    """

    def __init__(self, send: Send, timeline: Timeline | None = None) -> None:
        self._send = send
        self.timeline = timeline
        self.drafters: set[str] = set()
        """Connected drafter trainers."""
        self.published: DrafterWeights | None = None
        self.trained: tuple[int, float] = (0, 0.0)
        """The current version's drafter trainer: optimizer steps and seconds of training by then."""
        """The current drafter version, as generators receive it."""
        self._tensors: list[torch.Tensor] = []
        self.generator_drafters: dict[str, tuple[int, str]] = {}
        """Drafter version and checksum each generator acknowledged serving."""
        self.refusals: dict[str, str] = {}
        """Generators that refused a drafter version, with their reason (last one each)."""
        self.counts: dict[tuple[int, int], AcceptanceCounts] = {}
        """(drafter version, policy version) → counters of the chunks drafted under them."""
        self.paused = False
        self._taken: dict[tuple[int, int], AcceptanceCounts] = {}

    # ---- peers ------------------------------------------------------------------------------

    def add_drafter(self, actor: str) -> None:
        self.drafters.add(actor)

    def remove(self, actor: str) -> None:
        """Forget a peer that is gone (a drafter trainer or a generator)."""
        self.drafters.discard(actor)
        self.generator_drafters.pop(actor, None)
        self.refusals.pop(actor, None)

    def on_generator_hello(self, actor: str) -> None:
        """Announce the current drafter version to a generator or drafter trainer that just joined."""
        if self.published is not None:
            self._send(actor, self._announcement(), None)

    # ---- inbound ----------------------------------------------------------------------------

    def on_publish(self, actor: str, msg: PublishDrafter, tensors: dict[str, torch.Tensor]) -> None:
        """A drafter trainer published a version: keep it and announce it to ``generators``. One over
        the protocol's bounds on a drafter version is refused with an ``Error`` (every generator would
        fetch it)."""
        try:
            check_at_most("PublishDrafter.version", msg.version, MAX_VERSION, "protocol limit")
            check_at_most("PublishDrafter.len(tensors)", len(msg.tensors), MAX_DRAFTER_TENSORS, "protocol limit")
            check_at_most("PublishDrafter.len(config)", len(msg.config), MAX_DRAFTER_CONFIG_CHARS, "protocol limit")
            check_at_most("PublishDrafter.len(checksum)", len(msg.checksum), MAX_ID_CHARS, "protocol limit")
        except LimitExceeded as e:
            self._send(actor, Error(code="bad_request", message=str(e)), None)
            return
        have = self.published.version if self.published is not None else 0
        if msg.version <= have:  # a restarted or second drafter trainer: it numbers the next one above
            self._send(actor, Error(code="bad_request", message=f"drafter version {msg.version} is not above "
                                    f"the published {have}; the next one is numbered above it"), None)
            self._send(actor, self._announcement(), None)
            return
        self._tensors = [tensors[ref.name] for ref in msg.tensors]
        self.published = DrafterWeights(version=msg.version, policy_version=msg.policy_version, config=msg.config,
                                        checksum=msg.checksum, tensors=msg.tensors)
        log.info("drafter version %d published by %s (trained against policy %d, %d steps)", msg.version, actor,
                 msg.policy_version, msg.train_steps)
        self.trained = (msg.train_steps, msg.train_s)
        if self.timeline is not None:
            self.timeline.record("drafter_published", version=msg.version, train_steps=msg.train_steps,
                                 train_s=msg.train_s)
        for other in self.drafters - {actor}:  # concurrent drafter trainers keep one numbering
            self._send(other, self._announcement(), None)

    def announce_to(self, generators: list[str]) -> None:
        if self.published is not None:
            for actor in generators:
                self._send(actor, self._announcement(), None)

    def on_fetch(self, actor: str, msg: FetchDrafter) -> None:
        """Answer a generator's fetch with the current version. A fetch of an older version is not an
        error: only the newest is kept, and a drafter trainer publishing faster than a fetch's round
        trip overtakes it (the generator dropped the old fetch when the newer announcement reached it,
        and fetches that one); it is answered with the current announcement only, in case it did not.
        A version never published is a bad request."""
        p = self.published
        if p is not None and msg.version < p.version:
            self._send(actor, self._announcement(), None)
            return
        if p is None or p.version != msg.version:
            self._send(actor, Error(code="bad_request", message=f"drafter version {msg.version} is not published "
                                    f"(current: {p.version if p else None})"), None)
            if p is not None:
                self._send(actor, self._announcement(), None)  # fetch the current one instead
            return
        self._send(actor, p, self._tensors)

    def on_ack(self, actor: str, msg: AckDrafter) -> None:
        if msg.refused:
            self.refusals[actor] = msg.refused
            log.error("generator %s refused drafter version %d: %s", actor, msg.version, msg.refused)
            return
        self.generator_drafters[actor] = (msg.version, msg.checksum)
        if self.timeline is not None:
            self.timeline.record("drafter_served", actor=actor, version=msg.version)
        p = self.published
        if p is not None and p.version == msg.version and p.checksum != msg.checksum:
            log.error("generator %s serves drafter version %d with checksum %s..., published %s...", actor,
                      msg.version, msg.checksum[:12], p.checksum[:12])

    def on_chunk(self, chunk: RolloutChunk) -> None:
        """Count the chunk's drafts under its drafter and policy version."""
        spec = chunk.spec
        if spec is None or not spec.num_draft_steps or not chunk.versions:
            return
        c = self.counts.setdefault((spec.drafter_version, max(chunk.versions)), AcceptanceCounts())
        c.num_drafted += spec.num_drafted
        c.num_accepted += spec.num_accepted
        c.num_draft_steps += spec.num_draft_steps

    def on_group_finished(self, group: Group) -> None:
        """Send the group's rollouts to every drafter trainer."""
        if not self.drafters:
            return
        rollouts = [RolloutTokens(prompt_token_ids=group.prompt_token_ids, token_ids=s.token_ids,
                                  policy_version=max(s.versions))
                    for s in group.samples if s.token_ids]
        if rollouts:
            for actor in self.drafters:
                self._send(actor, FinishedRollouts(rollouts=rollouts), None)

    def tick(self, live_seqs: int, max_seqs: int) -> None:
        """Send every drafter trainer the generators' load (the client calls this twice a second)."""
        for actor in self.drafters:
            self._send(actor, Capacity(live_seqs=live_seqs, max_seqs=max_seqs, pause=self.paused), None)

    # ---- reading ----------------------------------------------------------------------------

    def acceptance(self) -> dict[tuple[int, int], AcceptanceCounts]:
        """(drafter version, policy version) → counters, as summed so far."""
        return dict(self.counts)

    def take_window(self) -> dict[tuple[int, int], AcceptanceCounts]:
        """The counters added since the last call, per (drafter version, policy version) with drafts."""
        window = {}
        for key, c in self.counts.items():
            t = self._taken.get(key, AcceptanceCounts())
            d = AcceptanceCounts(c.num_drafted - t.num_drafted, c.num_accepted - t.num_accepted,
                                 c.num_draft_steps - t.num_draft_steps)
            if d.num_draft_steps:
                window[key] = d
            self._taken[key] = AcceptanceCounts(c.num_drafted, c.num_accepted, c.num_draft_steps)
        return window

    def report(self, floor: float = 0.0) -> dict[str, object]:
        """Monitoring for a metrics line: the counters since the last report per (drafter, policy)
        version, their overall acceptance length, the published drafter version, the policy it
        was trained against and the training steps and seconds behind it, what each generator
        serves and whether the checksums agree. When the
        newest policy version's acceptance length is below ``floor`` (> 0) it logs a warning and
        returns its text as ``acceptance_floor_warning`` (``specroll launch`` prints it), else None."""
        window = self.take_window()
        steps = sum(c.num_draft_steps for c in window.values())
        pairs = [{"drafter_version": d, "policy_version": p, "acceptance_length": c.acceptance_length,
                  "draft_steps": c.num_draft_steps} for (d, p), c in sorted(window.items())]
        warning = None
        if window and floor > 0:
            newest = max(p for _, p in window)
            c = AcceptanceCounts()
            for (_, p), w in window.items():
                if p == newest:
                    c.num_accepted += w.num_accepted
                    c.num_draft_steps += w.num_draft_steps
            length = c.acceptance_length
            if length is not None and length < floor:
                published = self.published
                warning = (f"acceptance length {length:.2f} under policy version {newest} is below the floor "
                           f"{floor:.2f} (drafter version {published.version if published else None}, trained "
                           f"against policy {published.policy_version if published else None}): is the drafter "
                           f"trainer keeping up?")
                log.warning("%s", warning)
        p = self.published
        return {
            "acceptance_length_window": 1 + sum(c.num_accepted for c in window.values()) / steps if steps else None,
            "acceptance_by_version": pairs,
            "acceptance_below_floor": warning is not None,
            "acceptance_floor_warning": warning,
            "drafter_version": p.version if p else None,
            "drafter_policy_version": p.policy_version if p else None,
            "drafter_train_steps": self.trained[0] if p else None,
            "drafter_train_s": self.trained[1] if p else None,
            "generator_drafters": {a: v for a, (v, _) in self.generator_drafters.items()},
            "drafter_checksums_match": self.checksums_match(),
            "drafter_trainers": len(self.drafters),
        }

    def checksums_match(self) -> bool:
        """Every generator that serves the current drafter version serves the published bytes."""
        p = self.published
        return p is None or all(c == p.checksum for v, c in self.generator_drafters.values() if v == p.version)

    def _announcement(self) -> DrafterAvailable:
        p = self.published
        assert p is not None
        return DrafterAvailable(version=p.version, policy_version=p.policy_version, checksum=p.checksum)
