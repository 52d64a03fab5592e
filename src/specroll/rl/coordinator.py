"""The rollout coordinator: which group runs where, what has streamed back, and what is finished.

A pure state machine with no I/O (the trainer actor and the embedding client drive it from their
receive loops, so it is tested without sockets). It keeps, for every group in flight, the prompt,
the generator serving it and each sample's tokens, behavior logprobs and per-token policy versions
as they stream in; it hands out groups by the free capacity generators report; and when a
generator dies it sends that generator's unfinished groups elsewhere as ``SubmitGroup(resume=...)``
carrying every token already streamed, so a rollout continues from prompt + its own token ids
(never re-tokenized text) and nothing is lost or duplicated:

- a chunk must start exactly where the trainer's copy of its sample ends (``offset``); a chunk that
  overlaps what is held must agree with it and only its new tail is kept; a gap, a disagreement,
  tokens after the finish or beyond the group's ``max_tokens`` are refused (:class:`ChunkError`);
- chunks from a generator that no longer serves the group (it was declared dead, or the group was
  aborted) are ignored and counted, never merged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from specroll.protocol.limits import MAX_ID_CHARS
from specroll.protocol.messages import RolloutChunk, SampleResume, SubmitGroup
from specroll.protocol.sampling import SamplingParams

Lane = Literal["train", "eval", "serve"]
"""What a group is for: ``train`` groups count against ``max_groups_in_flight`` and feed training;
``eval`` groups (held-out evaluation) are dispatched before any queued training group, do not count
against that bound, and finish into a queue of their own, so training never sees them; ``serve``
groups (requests of the HTTP server, ``actors/server/``) likewise, dispatched after evaluation and
before training, and never queued when finished: whoever submitted one holds it
(:attr:`RolloutCoordinator.groups` while it is live) and is told by the hub's chunk callback."""
LANES: tuple[Lane, ...] = ("eval", "serve", "train")  # dispatch order


class ChunkError(ValueError):
    """A rollout chunk that cannot be merged: unknown group or sample, a gap, a disagreement with
    tokens already held, tokens after the sample finished or beyond its ``max_tokens``, or a group
    id longer than :data:`~specroll.protocol.limits.MAX_ID_CHARS`."""


def check_chunk_group_id(chunk: RolloutChunk) -> None:
    """Bound the chunk's group id before it is looked up or parsed anywhere.

    Raises:
        ChunkError: an id longer than :data:`~specroll.protocol.limits.MAX_ID_CHARS`.
    """
    if len(chunk.group_id) > MAX_ID_CHARS:
        raise ChunkError(f"RolloutChunk.len(group_id) = {len(chunk.group_id)} is over the limit {MAX_ID_CHARS} "
                         "(protocol limit)")


@dataclass
class Sample:
    """One response of a group, as streamed so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behavior logprobs (natural log, under the processed distribution that sampled each token)."""
    versions: list[int] = field(default_factory=list)
    """The policy version of the weights that produced each token."""
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Group:
    """n samples of one prompt, in flight or finished."""

    group_id: str
    prompt_token_ids: list[int]
    samples: list[Sample]
    sampling: SamplingParams
    payload: object = None
    """Whatever the caller attached to the prompt (e.g. the reference answer for the reward)."""
    lane: Lane = "train"
    generator: str | None = None
    """Actor id serving it now; None while queued."""
    dispatches: int = 0
    """Times it was sent to a generator (1 + resumes after deaths)."""
    pin: str | None = None
    """A generator it should run on while that one is connected (an HTTP session's: prefix-cache
    reuse across turns); it waits in the queue while that generator is full, and goes anywhere once
    it is gone. None: wherever there is most room."""
    refused: str | None = None
    """Why its generator refused it (a served request's group; its samples then end as aborted)."""

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def submit_message(self) -> SubmitGroup:
        """The ``SubmitGroup`` for this group now: fresh, or resuming its unfinished samples."""
        resume: tuple[SampleResume, ...] = ()
        if any(s.token_ids or s.finished for s in self.samples):
            resume = tuple(
                SampleResume(index=i, token_ids=list(s.token_ids), logprobs=list(s.logprobs),
                             versions=list(s.versions))
                for i, s in enumerate(self.samples) if not s.finished
            )
        return SubmitGroup(group_id=self.group_id, prompt_token_ids=list(self.prompt_token_ids),
                           n=len(self.samples), sampling=self.sampling, resume=resume)


@dataclass
class GeneratorState:
    """What the coordinator knows of one generator."""

    actor_id: str
    free_groups: int = 0
    """Groups it can still take, as of its last heartbeat minus groups sent since."""
    free_seqs: int | None = None
    """Samples it can still take, as of its last heartbeat minus samples sent since (None: it reports
    groups only, and a group of any size takes one of ``free_groups``)."""
    policy_version: int = 0
    """The policy version it serves: the newest its heartbeats or acknowledgements reported (one
    incarnation's engine only moves forward; the two messages may arrive in either order)."""
    groups: set[str] = field(default_factory=set)


class RolloutCoordinator:
    """Dispatch groups to generators by free capacity, assemble streamed chunks, resume after deaths.

    Args:
        max_groups_in_flight: most groups dispatched and unfinished at once (bounds staleness:
            the off-step pipeline never runs further ahead than this).
    """

    def __init__(self, max_groups_in_flight: int) -> None:
        if max_groups_in_flight <= 0:
            raise ValueError(f"max_groups_in_flight={max_groups_in_flight}, expected a positive integer")
        self.max_groups_in_flight = max_groups_in_flight
        self.groups: dict[str, Group] = {}
        """Every group queued or in flight, by id."""
        self.generators: dict[str, GeneratorState] = {}
        self._queues: dict[Lane, deque[str]] = {lane: deque() for lane in LANES}
        """Group ids waiting for a generator, oldest first, per lane."""
        self._finished: dict[Lane, deque[Group]] = {lane: deque() for lane in LANES}
        self._next_id = 0
        self.ignored_chunks = 0
        """Chunks from a generator that no longer serves their group (late after a death or abort)."""
        self.resumed_groups = 0
        """Groups sent to another generator after theirs died."""

    # ---- prompts and generators -----------------------------------------------------------

    def add_group(self, prompt_token_ids: list[int], n: int, sampling: SamplingParams, payload: object = None,
                  lane: Lane = "train", pin: str | None = None) -> str:
        """Queue a group of ``n`` samples of one prompt in ``lane`` (see :data:`Lane`), on generator
        ``pin`` if it is connected when dispatched (:attr:`Group.pin`); returns its id.

        Raises:
            ValueError: empty prompt or ``n`` < 1.
        """
        if not prompt_token_ids:
            raise ValueError("empty prompt: expected at least one token id")
        if n < 1:
            raise ValueError(f"n={n}, expected at least one sample per group")
        if lane not in LANES:
            raise ValueError(f"lane={lane!r}, expected one of {LANES}")
        group_id = f"g{self._next_id}"
        self._next_id += 1
        self.groups[group_id] = Group(group_id, list(prompt_token_ids), [Sample() for _ in range(n)], sampling,
                                      payload, lane, pin=pin)
        self._queues[lane].append(group_id)
        return group_id

    def add_generator(self, actor_id: str) -> None:
        """A generator completed its handshake (a restarted one comes back under a new id)."""
        self.generators.setdefault(actor_id, GeneratorState(actor_id))

    def on_heartbeat(self, actor_id: str, free_groups: int, policy_version: int, free_seqs: int | None = None) -> None:
        """Record a generator's reported capacity (groups, and samples when it reports them) and
        served policy version."""
        gen = self.generators.get(actor_id)
        if gen is not None:
            gen.free_groups, gen.free_seqs = free_groups, free_seqs
            gen.policy_version = max(gen.policy_version, policy_version)

    def on_served(self, actor_id: str, policy_version: int) -> None:
        """A generator acknowledged serving ``policy_version`` (``AckWeights``)."""
        gen = self.generators.get(actor_id)
        if gen is not None:
            gen.policy_version = max(gen.policy_version, policy_version)

    def served_versions(self) -> dict[str, int]:
        """The policy version each connected generator serves, by actor id."""
        return {a: g.policy_version for a, g in self.generators.items()}

    def remove_generator(self, actor_id: str) -> list[str]:
        """A generator died or left: its unfinished groups go back to the front of the queue, to
        resume elsewhere from what they streamed. Returns their ids."""
        gen = self.generators.pop(actor_id, None)
        if gen is None:
            return []
        orphans = sorted(gen.groups, key=lambda g: int(g[1:]))
        for group_id in reversed(orphans):  # oldest first at the front
            group = self.groups[group_id]
            group.generator = None
            self._queues[group.lane].appendleft(group_id)
        self.resumed_groups += len(orphans)
        return orphans

    # ---- dispatch ---------------------------------------------------------------------------

    def num_in_flight(self, lane: Lane = "train") -> int:
        """Groups of ``lane`` dispatched and not finished."""
        return sum(1 for g in self.groups.values() if g.generator is not None and g.lane == lane)

    def num_queued(self, lane: Lane = "train") -> int:
        """Groups of ``lane`` waiting for a generator."""
        return len(self._queues[lane])

    def num_pending(self, lane: Lane = "train") -> int:
        """Groups of ``lane`` queued or in flight."""
        return sum(1 for g in self.groups.values() if g.lane == lane)

    def dispatch(self) -> list[tuple[str, SubmitGroup]]:
        """Assign queued groups to generators with room for them, most room first (a pinned group to
        its generator while that one is connected: it waits while that one is full, without holding
        up the groups behind it): evaluation groups first, then served requests, then training groups
        while fewer than ``max_groups_in_flight`` of them are in flight. Returns (actor id, message)
        pairs to send."""
        out = []
        for lane in LANES:
            queue = self._queues[lane]
            budget = self.max_groups_in_flight - self.num_in_flight("train") if lane == "train" else len(queue)
            waiting: list[str] = []  # pinned groups whose generator is full: they keep their place
            while queue and budget > 0:
                group = self.groups[queue[0]]
                size = sum(not s.finished for s in group.samples)
                pinned = self.generators.get(group.pin) if group.pin is not None else None
                if pinned is not None:
                    if self._room(pinned, size) <= 0:
                        waiting.append(queue.popleft())
                        continue
                    gen = pinned
                else:
                    gen = max(self.generators.values(), key=lambda g: (self._room(g, size), -len(g.groups)),
                              default=None)
                    if gen is None or self._room(gen, size) <= 0:
                        break
                queue.popleft()
                group.generator = gen.actor_id
                group.dispatches += 1
                gen.groups.add(group.group_id)
                gen.free_groups = max(0, gen.free_groups - 1)
                if gen.free_seqs is not None:
                    gen.free_seqs -= size
                budget -= 1
                out.append((gen.actor_id, group.submit_message()))
            queue.extendleft(reversed(waiting))
        return out

    @staticmethod
    def _room(gen: GeneratorState, size: int) -> int:
        """How many groups of ``size`` samples ``gen`` can take now."""
        return gen.free_groups if gen.free_seqs is None else gen.free_seqs // max(size, 1)

    # ---- chunks -----------------------------------------------------------------------------

    def on_chunk(self, actor_id: str, chunk: RolloutChunk) -> Group | None:
        """Merge one chunk; returns the group when this chunk finished it (it then leaves the
        coordinator and is also queued for :meth:`pop_finished`).

        Raises:
            ChunkError: the chunk cannot be merged (see the module docstring); nothing is changed.
        """
        check_chunk_group_id(chunk)
        group = self.groups.get(chunk.group_id)
        if group is None or group.generator != actor_id:
            if group is None and not self._issued(chunk.group_id):
                raise ChunkError(f"chunk for unknown group {chunk.group_id!r}")
            self.ignored_chunks += 1  # late: the group finished, was aborted or moved elsewhere
            return None
        if chunk.sample_index >= len(group.samples):
            raise ChunkError(f"group {chunk.group_id!r} has {len(group.samples)} samples; "
                             f"chunk for sample {chunk.sample_index}")
        sample = group.samples[chunk.sample_index]
        held = len(sample.token_ids)
        where = f"group {chunk.group_id!r} sample {chunk.sample_index}"
        if sample.finished:
            if chunk.token_ids or not chunk.finished:
                raise ChunkError(f"{where} already finished ({sample.finish_reason}); got more tokens")
            return None
        if chunk.offset > held:
            raise ChunkError(f"{where}: chunk at offset {chunk.offset}, but only {held} tokens are held (a gap)")
        end, limit = chunk.offset + len(chunk.token_ids), group.sampling.max_tokens
        if end > limit:  # before the overlap is compared: that work is then bounded by max_tokens too
            raise ChunkError(f"{where}: RolloutChunk.offset + len(token_ids) = {end} is over the limit {limit} "
                             "(the group's sampling.max_tokens)")
        overlap = held - chunk.offset
        if chunk.token_ids[:overlap] != sample.token_ids[chunk.offset:]:
            raise ChunkError(f"{where}: chunk at offset {chunk.offset} disagrees with the tokens already held")
        sample.token_ids.extend(chunk.token_ids[overlap:])
        sample.logprobs.extend(chunk.logprobs[overlap:])
        sample.versions.extend(chunk.versions[overlap:])
        if chunk.finished:
            sample.finish_reason = chunk.finish_reason
        if not group.finished:
            return None
        self._retire(group)
        if group.lane != "serve":  # a served request's submitter holds it
            self._finished[group.lane].append(group)
        return group

    def _issued(self, group_id: str) -> bool:
        """Whether this coordinator ever created ``group_id``."""
        number = group_id[1:]  # ids are "g<int>": ASCII digits (int() refuses "²"), never more than int64's 19
        return (group_id[:1] == "g" and number.isascii() and number.isdigit() and len(number) <= 19
                and int(number) < self._next_id)

    def _retire(self, group: Group) -> None:
        del self.groups[group.group_id]
        if group.generator is not None and group.generator in self.generators:
            gen = self.generators[group.generator]
            gen.groups.discard(group.group_id)
            gen.free_groups += 1  # until its next heartbeat says otherwise
            if gen.free_seqs is not None:
                gen.free_seqs += len(group.samples)

    def abort(self, group_id: str) -> str | None:
        """Drop a group; returns the generator to send ``Abort`` to (None if it was queued).

        Raises:
            KeyError: no such group queued or in flight.
        """
        group = self.groups[group_id]
        if group_id in self._queues[group.lane]:
            self._queues[group.lane].remove(group_id)
        self._retire(group)
        return group.generator

    def pop_finished(self, limit: int | None = None, lane: Lane = "train") -> list[Group]:
        """Finished groups of ``lane``, oldest first (at most ``limit``)."""
        finished = self._finished[lane]
        out = []
        while finished and (limit is None or len(out) < limit):
            out.append(finished.popleft())
        return out

    def num_finished(self, lane: Lane = "train") -> int:
        """Finished groups of ``lane`` not yet popped."""
        return len(self._finished[lane])

    def groups_of(self, actor_id: str) -> Iterable[str]:
        """Ids of the groups a generator serves now."""
        gen = self.generators.get(actor_id)
        return sorted(gen.groups) if gen is not None else []
