"""The live samples of a generator's engine: their streams by request and group, and the chunks
they make (``RolloutChunk`` deltas). Synchronous; only the generator's step loop calls it.

A sample's unsent tokens become a chunk every ``stream_every`` engine steps, when it finishes, and
whenever :meth:`LiveSamples.flush` is called (before a policy or drafter swap, so that each chunk's
tokens come from one policy version and its draft counts from one drafter version).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import msgspec

from specroll.actors.generator.drafter_swap import DrafterSlot
from specroll.actors.generator.rollout_stream import SampleStream
from specroll.actors.telemetry.generator_metrics import RequestLatency
from specroll.engine.engine import Engine
from specroll.engine.sequence import StepOutput
from specroll.protocol.messages import ErrorCode, FinishReason, RolloutChunk, SubmitGroup
from specroll.protocol.sampling import sample_seed


class SampleRefused(Exception):
    """A submit or abort the engine cannot take; ``code`` and the message go back as an ``Error``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LiveSamples:
    """The live samples of ``engine`` (module docstring).

    Args:
        engine: the generator's engine.
        drafter: the drafter slot; its counter records drafts per step, its version labels chunks.
        put: queues a chunk for the trainer.
        stream_every: engine steps between a sample's chunks at most.
        speculative: chunks carry ``SpecStats``.
        latency: times the requests (``[metrics] enabled``), or None.
    """

    def __init__(self, engine: Engine, drafter: DrafterSlot, put: Callable[[RolloutChunk], None], stream_every: int,
                 speculative: bool, latency: RequestLatency | None = None) -> None:
        self.engine = engine
        self.drafter = drafter
        self.put = put
        self.stream_every = stream_every
        self.speculative = speculative
        self.streams: dict[str, SampleStream] = {}
        """request id → stream of every live sample."""
        self.groups: dict[str, dict[int, SampleStream]] = {}
        """group id → its live samples by index."""
        self.num_tokens = 0
        """Response tokens emitted since the start."""
        self._abandoned: set[str] = set()
        """Request ids forgotten by :meth:`abandon`, still to be aborted in the engine."""
        self.latency = latency

    def submit(self, msg: SubmitGroup) -> None:
        """Add the group's samples (those of ``msg.resume`` only, when it resumes a group).

        Raises:
            SampleRefused: the group is live here already, or the engine refused a sample (nothing
                of the group is added then).
        """
        self.drop_abandoned()  # a resumed sample reuses its request id; abandon() may have run mid-inbox
        if msg.group_id in self.groups:
            raise SampleRefused("bad_request", f"group {msg.group_id!r} is already live here")
        resumed = {r.index: r for r in msg.resume}
        indices = sorted(resumed) if resumed else range(msg.n)
        streams: list[SampleStream] = []
        added: list[SampleStream] = []
        try:
            for i in indices:
                done = resumed[i] if i in resumed else None
                n_done = len(done.token_ids) if done else 0
                stream = SampleStream(msg.group_id, i, msg.prompt_token_ids, msg.sampling,
                                      sent=n_done, engine_base=n_done)
                streams.append(stream)
                if stream.remaining > 0:
                    self._add(stream, msg.prompt_token_ids + (done.token_ids if done else []))
                    added.append(stream)
        except ValueError as e:
            for stream in added:
                self.engine.abort(stream.request_id)
                if self.latency is not None:
                    self.latency.forget(stream.request_id)
            raise SampleRefused("bad_request", f"group {msg.group_id!r}: {e}") from None
        self.groups[msg.group_id] = {s.index: s for s in added}
        self.streams.update((s.request_id, s) for s in added)
        for stream in streams:
            if stream.remaining <= 0:  # resumed with its whole budget already used
                self._finish(stream, "length")

    def abort(self, group_id: str) -> None:
        """End the group's samples with ``"abort"`` chunks.

        Raises:
            SampleRefused: the group is not live here.
        """
        group = self.groups.get(group_id)
        if group is None:
            raise SampleRefused("unknown_group", f"abort of group {group_id!r}, which is not live here")
        for stream in list(group.values()):
            done = self.engine.abort(stream.request_id)
            assert stream.engine_base + len(done.token_ids) == stream.num_response_tokens, stream.request_id
            self._finish(stream, "abort")

    def abandon(self) -> int:
        """Forget every live sample without another chunk: the generator registers again, and the trainer
        no longer counts them as its own (one that declared it gone resumes them elsewhere, maybe here
        under the same group ids; a new trainer never knew them). Their engine requests end at
        :meth:`drop_abandoned`, between engine steps; a step's outputs for them are ignored until then.
        Returns the number of groups forgotten."""
        groups = len(self.groups)
        if self.latency is not None:
            now = time.monotonic()
            for request_id in self.streams:
                self.latency.finished_now(request_id, "abort", now)
        self._abandoned.update(self.streams)
        self.streams.clear()
        self.groups.clear()
        return groups

    def drop_abandoned(self) -> None:
        """End the engine requests :meth:`abandon` forgot (between engine steps, before any new submit:
        a resumed sample may reuse a request id)."""
        if not self._abandoned:
            return
        for request_id in self._abandoned:
            with contextlib.suppress(KeyError):  # it finished in the step that ran meanwhile
                self.engine.abort(request_id)
        self._abandoned.clear()

    def on_outputs(self, outputs: Sequence[StepOutput]) -> None:
        """Take one engine step's deltas: extend the streams, send what is due."""
        counter = self.drafter.counter
        drafted = counter.drafted if counter is not None else {}
        latency = self.latency
        now = time.monotonic() if latency is not None else 0.0  # metrics off: nothing more per step
        if self._abandoned:  # the step ran while abandon() forgot these: once per step, not per output
            outputs = [out for out in outputs if out.request_id not in self._abandoned]
        for out in outputs:
            stream = self.streams[out.request_id]
            if latency is not None and out.new_token_ids:
                latency.emitted(out.request_id, now)
            stream.extend(out.new_token_ids, out.new_logprobs, out.new_versions)
            stream.count_spec(drafted.get(out.request_id, 0), len(out.new_token_ids))
            self.num_tokens += len(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None
                self._finish(stream, out.finish_reason)
        drafted.clear()
        for stream in self.streams.values():
            if stream.token_ids:
                stream.steps_waiting += 1
                if stream.steps_waiting >= self.stream_every:
                    self.put(self._chunk(stream))

    def flush(self) -> None:
        """Send every live sample's unsent tokens now."""
        for stream in self.streams.values():
            if stream.token_ids:
                self.put(self._chunk(stream))

    def recompute(self) -> None:
        """Re-prefill every live request under the new weights: abort it and add it again with its
        response so far folded into the prompt. Its emitted tokens stay in the stream (with their
        versions); only the K/V is recomputed, nothing is sent twice."""
        for request_id in self.engine.live_request_ids():
            stream = self.streams[request_id]
            prompt = self.engine.prompt_token_ids(request_id)
            response, _, _ = self.engine.output_so_far(request_id)
            self.engine.abort(request_id)
            stream.engine_base += len(response)
            assert stream.engine_base == stream.num_response_tokens, request_id
            self._add(stream, prompt + response)

    def _add(self, stream: SampleStream, prompt: list[int]) -> None:
        """Queue the engine request of ``stream`` with ``prompt`` and the remaining budget.

        Raises:
            ValueError: from ``Engine.add_request`` (e.g. a prompt too long for the context).
        """
        sampling = stream.sampling
        seed = sampling.seed
        if seed is not None:  # siblings (and re-prefills) of a seeded group must not share one stream
            seed = sample_seed(seed, stream.index, stream.engine_base)
        sampling = msgspec.structs.replace(sampling, max_tokens=stream.remaining, seed=seed)
        self.engine.add_request(prompt, sampling, stream.request_id, group_id=stream.group_id)
        if self.latency is not None:
            self.latency.admitted(stream.request_id, time.monotonic())

    def _finish(self, stream: SampleStream, reason: FinishReason) -> None:
        """Send the sample's final chunk and forget it (and its group once every sample finished)."""
        self.put(self._chunk(stream, reason))
        self.streams.pop(stream.request_id, None)
        if self.latency is not None:
            self.latency.finished_now(stream.request_id, reason, time.monotonic())
        group = self.groups.get(stream.group_id)
        if group is not None:
            group.pop(stream.index, None)
            if not group:
                del self.groups[stream.group_id]

    def _chunk(self, stream: SampleStream, reason: FinishReason | None = None) -> RolloutChunk:
        return stream.take_chunk(reason, speculative=self.speculative, drafter_version=self.drafter.version)
