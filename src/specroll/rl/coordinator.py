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

A group that keeps failing is retried a bounded number of times, then dropped whole
(``group_retries.py``): a generator that dies with it (``lost``) or sends a chunk of it that is
refused (``refused``; :meth:`RolloutCoordinator.take_back`) costs it one of ``max_group_retries``
retries — it resumes on another generator while one has room — and one failure more drops it: it
leaves the coordinator, none of its samples kept, and its submitter is told
(:meth:`RolloutCoordinator.pop_dropped`). So no generator holds a group for ever by sending chunks
that cannot be merged. The queue is bounded too: past ``max_queued_groups`` groups waiting for a
generator, :meth:`RolloutCoordinator.add_group` raises :class:`QueueFull`.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from specroll.protocol.messages import RolloutChunk, SubmitGroup
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator_errors import ChunkError, QueueFull, check_chunk_group_id
from specroll.rl.group_retries import DroppedGroup, DropReason, GroupRetries
from specroll.rl.groups import DEFAULT_MAX_GROUP_RETRIES, LANES, Group, Lane, Sample

__all__ = ["LANES", "ChunkError", "GeneratorState", "Group", "Lane", "QueueFull", "RolloutCoordinator", "Sample",
           "check_chunk_group_id"]

DEFAULT_MAX_QUEUED_GROUPS = 1024
"""``trainer.max_queued_groups``'s default: groups waiting for a generator, at most."""
MAX_QUEUED_GROUPS = 1 << 20
"""The largest ``max_queued_groups`` accepted (each queued group holds its prompt in memory)."""


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
    """Dispatch groups to generators by free capacity, assemble streamed chunks, resume after deaths
    and refusals, drop a group that keeps failing (module docstring).

    Args:
        max_groups_in_flight: most training groups dispatched and unfinished at once (bounds
            staleness: the off-step pipeline never runs further ahead than this).
        max_group_retries: failures (refused, lost) a group survives; one more drops it.
        max_queued_groups: most groups waiting for a generator, every lane together; one more is
            refused (:class:`QueueFull`). Groups queued again after a failure are not refused.

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, max_groups_in_flight: int, max_group_retries: int = DEFAULT_MAX_GROUP_RETRIES,
                 max_queued_groups: int = DEFAULT_MAX_QUEUED_GROUPS) -> None:
        if not _is_count(max_groups_in_flight) or max_groups_in_flight <= 0:
            raise ValueError(f"max_groups_in_flight={max_groups_in_flight!r}, expected a positive integer")
        if not _is_count(max_queued_groups) or not 1 <= max_queued_groups <= MAX_QUEUED_GROUPS:
            raise ValueError(f"max_queued_groups={max_queued_groups!r}, expected an integer in "
                             f"[1, {MAX_QUEUED_GROUPS}]")
        GroupRetries(max_group_retries)  # checks its range
        self.max_groups_in_flight = max_groups_in_flight
        self.max_group_retries, self.max_queued_groups = max_group_retries, max_queued_groups
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
        """Groups queued again to resume after a failure (their generator died, or sent a refused chunk)."""
        self._dropped: dict[Lane, deque[DroppedGroup]] = {lane: deque() for lane in LANES}
        self.groups_dropped: Counter[DropReason] = Counter()
        """Groups dropped by the retry rule, by their last failure's reason, every lane."""
        self.on_drop: Callable[[Group], None] | None = None
        """Called with each group as it is dropped (:attr:`Group.dropped` set), after it left."""

    # ---- prompts and generators -----------------------------------------------------------

    def add_group(self, prompt_token_ids: list[int], n: int, sampling: SamplingParams, payload: object = None,
                  lane: Lane = "train", pin: str | None = None) -> str:
        """Queue a group of ``n`` samples of one prompt in ``lane`` (see :data:`Lane`), on generator
        ``pin`` if it is connected when dispatched (:attr:`Group.pin`); returns its id.

        Raises:
            ValueError: empty prompt or ``n`` < 1.
            QueueFull: ``max_queued_groups`` groups are waiting already; nothing was queued.
        """
        if not prompt_token_ids:
            raise ValueError("empty prompt: expected at least one token id")
        if n < 1:
            raise ValueError(f"n={n}, expected at least one sample per group")
        if lane not in LANES:
            raise ValueError(f"lane={lane!r}, expected one of {LANES}")
        if sum(len(q) for q in self._queues.values()) >= self.max_queued_groups:
            raise QueueFull(self.max_queued_groups)
        group_id = f"g{self._next_id}"
        self._next_id += 1
        self.groups[group_id] = Group(group_id, list(prompt_token_ids), [Sample() for _ in range(n)], sampling,
                                      payload, lane, pin=pin, retries=GroupRetries(self.max_group_retries))
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

    def remove_generator(self, actor_id: str, why: str = "it is gone") -> list[str]:
        """A generator died or left (``why``): each of its unfinished groups fails (``lost``) and goes
        back to the front of the queue, to resume elsewhere from what it streamed — or, past
        ``max_group_retries``, is dropped. Returns the ids of those that resume."""
        gen = self.generators.pop(actor_id, None)
        if gen is None:
            return []
        resumed = []
        for group_id in sorted(gen.groups, key=lambda g: int(g[1:]), reverse=True):  # oldest first at the front
            group = self.groups[group_id]
            group.generator = None
            group.failed_on.add(actor_id)
            if self._fail(group, "lost", f"generator {actor_id} is gone ({why})"):
                resumed.append(group_id)
        for group in self.groups.values():  # its last chunks will never come: nothing to wait for
            group.draining.pop(actor_id, None)
        return resumed[::-1]

    def take_back(self, actor_id: str, group_id: str, why: str, ended: Iterable[int] = ()) -> bool:
        """``actor_id`` serves ``group_id`` and sent a chunk of it that was refused, or refused the group
        (``why``): the group fails (``refused``) and is taken from it, to resume on another generator
        from the tokens held — or, past ``max_group_retries``, is dropped. Send that generator
        ``Abort``: the group is not sent back to it before the last chunk of every sample it may
        still run (all unfinished ones but ``ended``, which it ended already) arrived
        (:meth:`on_stale_chunk`). Returns whether it was taken (False: ``actor_id`` does not serve it;
        nothing changed)."""
        group = self.groups.get(group_id)
        if group is None or group.generator != actor_id:
            return False
        live = {i for i, s in enumerate(group.samples) if not s.finished} - set(ended)
        if live:
            group.draining[actor_id] = live
        self._release(group)
        group.generator = None
        group.failed_on.add(actor_id)
        self._fail(group, "refused", why)
        return True

    def on_stale_chunk(self, actor_id: str, chunk: RolloutChunk) -> None:
        """A chunk from a generator that no longer serves its group: a sample's last one (``finished``)
        means that generator no longer runs that sample (:meth:`take_back`)."""
        group = self.groups.get(chunk.group_id)
        live = group.draining.get(actor_id) if group is not None and chunk.finished else None
        if live is not None:
            live.discard(chunk.sample_index)
            if not live:
                del group.draining[actor_id]  # type: ignore[union-attr]

    def _fail(self, group: Group, reason: DropReason, why: str) -> bool:
        """A failure of ``group`` (not queued, no generator): queue it again at the front and return
        True, or past ``max_group_retries`` drop it and return False."""
        if group.retries.fail(reason, why):
            self._queues[group.lane].appendleft(group.group_id)
            self.resumed_groups += 1
            return True
        del self.groups[group.group_id]
        group.dropped = group.drop_record()
        self.groups_dropped[reason] += 1
        if group.lane != "serve":  # a served request's submitter holds it
            self._dropped[group.lane].append(group.dropped)
        if self.on_drop is not None:
            self.on_drop(group)
        return False

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
        up the groups behind it; a group that failed on a generator to another while one has room, and
        never to one still running some of it): evaluation groups first, then served requests, then
        training groups while fewer than ``max_groups_in_flight`` of them are in flight. Returns
        (actor id, message) pairs to send."""
        out = []
        for lane in LANES:
            queue = self._queues[lane]
            budget = self.max_groups_in_flight - self.num_in_flight("train") if lane == "train" else len(queue)
            waiting: list[str] = []  # groups that cannot go where there is room yet: they keep their place
            while queue and budget > 0 and self.generators:
                group = self.groups[queue[0]]
                size = sum(not s.finished for s in group.samples)
                pinned = self.generators.get(group.pin) if group.pin is not None else None
                if pinned is not None and pinned.actor_id not in group.failed_on:
                    if self._room(pinned, size) <= 0:
                        waiting.append(queue.popleft())
                        continue
                    gen = pinned
                else:
                    allowed = [g for g in self.generators.values() if g.actor_id not in group.draining]
                    if not allowed:  # every generator still runs some of it: wait for their last chunks
                        waiting.append(queue.popleft())
                        continue
                    elsewhere = [g for g in allowed if g.actor_id not in group.failed_on] or allowed
                    gen = max(elsewhere, key=lambda g: (self._room(g, size), -len(g.groups)))
                    if self._room(gen, size) <= 0:
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
            self.on_stale_chunk(actor_id, chunk)
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
        self._release(group)

    def _release(self, group: Group) -> None:
        """Give ``group``'s place on its generator back (until that one's next heartbeat says otherwise)."""
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

    def pop_dropped(self, limit: int | None = None, lane: Lane = "train") -> list[DroppedGroup]:
        """Groups of ``lane`` dropped by the retry rule and not yet popped, oldest first (at most
        ``limit``). A served request's group is never queued here (its submitter holds it)."""
        dropped = self._dropped[lane]
        return [dropped.popleft() for _ in range(len(dropped) if limit is None else min(limit, len(dropped)))]

    def num_dropped(self, lane: Lane = "train") -> int:
        """Dropped groups of ``lane`` not yet popped."""
        return len(self._dropped[lane])

    def groups_of(self, actor_id: str) -> Iterable[str]:
        """Ids of the groups a generator serves now."""
        gen = self.generators.get(actor_id)
        return sorted(gen.groups) if gen is not None else []


def _is_count(value: object) -> bool:
    """An int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
