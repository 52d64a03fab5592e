"""A fake engine with a fixed cost per step, served by the real generator actor (for ``bench_pipeline.py``).

:class:`FakeEngine` has exactly the :class:`~specroll.engine.engine.Engine` surface that
:class:`~specroll.actors.generator.actor.GeneratorActor` touches (``add_request``, ``step``, ``abort``,
``update_weights``, ``weight_version``, ``has_unfinished``, ``live_request_ids``,
``prompt_token_ids``, ``output_so_far``, ``num_live_requests``, ``max_model_len``, ``model_config``) and
no model (its :data:`FAKE_MODEL` only bounds what a trainer may send, as a real model's config does):

- **cost**: each :meth:`FakeEngine.step` sleeps ``step_s`` whatever the batch (up to ``max_num_seqs``
  requests), like a memory-bound decode step that reads every weight once, and emits one token per
  running request. A batch of 1 costs as much as a full one: that is what makes the long tail of a
  synchronous step expensive.
- **lengths**: a prompt made by :func:`encode_prompt` carries every sample's response length, so the
  benchmark, not the fake, decides the long tail. Sample ``i`` of a group is read from the request id,
  which the actor forms as ``"{group_id}/{i}"`` (``SampleStream.request_id``). Prompt tokens past the
  header are response tokens folded in by the actor (a resumed sample, or ``kv_policy="recompute"``),
  so a request always stops at its sample's length, however often it was re-added.
- **versions**: :meth:`FakeEngine.update_weights` records the version only; every token is tagged
  with the version current at the step that produced it. Prefill is free (not modelled).
- **timeline**: the engine records each step's ``(start, end, batch)`` and the intervals with no
  live request, on ``time.monotonic()`` (one clock for all processes on Linux), so the benchmark can
  cut any time window out of it afterwards.

Run one generator process around it (real ZeroMQ socket, real actor)::

    python benchmarks/fake_engine.py --connect tcp://127.0.0.1:PORT --step-s 0.02 --timeline /tmp/g0.json

:func:`start_fake_generator` and :func:`stop_processes` do that from a parent process (each child in
its own process group, killed and reaped on the way out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

import torch

from specroll.engine.block_manager import PrefixCacheCounters
from specroll.engine.model_config import ModelConfig
from specroll.engine.sequence import Completion, StepOutput
from specroll.protocol.messages import FinishReason

if TYPE_CHECKING:
    from specroll.protocol.sampling import SamplingParams

LENGTHS_MARK = 7
"""First token of a prompt made by :func:`encode_prompt`."""
RESPONSE_TOKEN = 1
"""The token id every fake response consists of (the pipeline never looks at token values)."""
LOGPROB = -1.0
"""Behavior logprob of every fake token."""
FAKE_MODEL = ModelConfig("llama", vocab_size=1 << 30, hidden_size=256, intermediate_size=1, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=256, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=1 << 30, tie_word_embeddings=True)
"""What the generator actor bounds a trainer's messages by: any token id and length the benchmark
sends, and one policy tensor, ``model.norm.weight`` ``[256]`` (``bench_pipeline.py`` publishes it)."""


def encode_prompt(prompt_id: int, lengths: Sequence[int]) -> list[int]:
    """A prompt telling :class:`FakeEngine` each sample's response length: ``[MARK, id, n, L_0..L_{n-1}]``.

    Raises:
        ValueError: no lengths, or a length below 1.
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths {list(lengths)[:8]}: expected at least one, each >= 1")
    return [LENGTHS_MARK, prompt_id, len(lengths), *lengths]


def decode_prompt(prompt: Sequence[int]) -> tuple[list[int], int]:
    """``(sample lengths, header length)`` of a prompt from :func:`encode_prompt` (plus folded tokens).

    Raises:
        ValueError: the prompt does not start with such a header.
    """
    if len(prompt) < 4 or prompt[0] != LENGTHS_MARK or not 0 < prompt[2] <= len(prompt) - 3:
        raise ValueError(f"prompt {list(prompt[:6])}...: expected [{LENGTHS_MARK}, id, n, n lengths] "
                         "(benchmarks/fake_engine.py encode_prompt)")
    n = prompt[2]
    return list(prompt[3:3 + n]), 3 + n


@dataclass
class _Request:
    request_id: str
    group_id: str | None
    prompt: list[int]
    target: int
    """Response tokens this request emits before it stops (its sample's length less folded tokens)."""
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class Timeline:
    """What the engine did, on ``time.monotonic()``."""

    steps: list[tuple[float, float, int]] = field(default_factory=list)
    """``(start, end, batch size)`` of every step that ran a batch."""
    idle: list[tuple[float, float]] = field(default_factory=list)
    """Closed intervals with no live request."""
    max_num_seqs: int = 0

    def write(self, path: Path) -> None:
        """Write it as JSON (atomically: a reader never sees half a file)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"steps": self.steps, "idle": self.idle, "max_num_seqs": self.max_num_seqs}))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> Timeline:
        d = json.loads(path.read_text())
        return cls([(a, b, int(n)) for a, b, n in d["steps"]], [(a, b) for a, b in d["idle"]], int(d["max_num_seqs"]))


class _FakeBlocks:
    """The block manager's face the generator reads: prefix-cache counters (each prompt counted at
    admission, none cached: a fake engine keeps no K/V) and a cache that has nothing to forget."""

    def __init__(self) -> None:
        self.prefix_counters = PrefixCacheCounters()

    def forget_cached(self) -> int:
        return 0


class FakeEngine:
    """The Engine API at a fixed cost per step (see the module docstring).

    Args:
        step_s: seconds each step sleeps, whatever the batch size.
        max_num_seqs: most requests decoded in one step; the rest wait, oldest first.
    """

    def __init__(self, step_s: float, max_num_seqs: int) -> None:
        if not step_s >= 0 or max_num_seqs < 1:
            raise ValueError(f"step_s={step_s}, max_num_seqs={max_num_seqs}: expected >= 0 and >= 1")
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.max_model_len = FAKE_MODEL.max_position_embeddings
        self.model_config = FAKE_MODEL
        self.weight_version = 0
        self.device = torch.device("cpu")  # the generator picks its weights transport by it
        self.timeline = Timeline(max_num_seqs=max_num_seqs)
        self.block_manager = _FakeBlocks()
        self._requests: dict[str, _Request] = {}  # arrival order: dicts keep insertion order
        self._idle_since: float | None = time.monotonic()

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams, request_id: str,
                    group_id: str | None = None) -> None:
        """Queue a request whose response length is read from its prompt.

        Raises:
            ValueError: duplicate ``request_id``, or a prompt not made by :func:`encode_prompt`.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already live")
        prompt = [int(t) for t in prompt_token_ids]
        lengths, header = decode_prompt(prompt)
        _, _, index = request_id.rpartition("/")
        i = int(index) if index.isdigit() else hash(request_id)
        target = lengths[i % len(lengths)] - (len(prompt) - header)
        self._requests[request_id] = _Request(request_id, group_id, prompt, max(1, target), sampling.max_tokens)
        self.block_manager.prefix_counters.prompt_tokens += len(prompt)
        if self._idle_since is not None:
            self.timeline.idle.append((self._idle_since, time.monotonic()))
            self._idle_since = None

    def abort(self, request_id: str) -> Completion:
        """Stop a request; returns every token it produced.

        Raises:
            KeyError: no live request has this id.
        """
        r = self._live(request_id)
        del self._requests[request_id]
        self._note_if_idle()
        return Completion(request_id, r.group_id, r.prompt, r.token_ids, [LOGPROB] * len(r.token_ids),
                          r.versions, "abort")

    def _live(self, request_id: str) -> _Request:
        r = self._requests.get(request_id)
        if r is None:
            raise KeyError(f"no live request {request_id!r}")
        return r

    def _note_if_idle(self) -> None:
        if not self._requests and self._idle_since is None:
            self._idle_since = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def prompt_token_ids(self, request_id: str) -> list[int]:
        return list(self._live(request_id).prompt)

    def output_so_far(self, request_id: str) -> tuple[list[int], list[float], list[int]]:
        r = self._live(request_id)
        return list(r.token_ids), [LOGPROB] * len(r.token_ids), list(r.versions)

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    # ---- stepping ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Sleep ``step_s``, then emit one token for each of the oldest ``max_num_seqs`` live requests."""
        batch = list(self._requests.values())[: self.max_num_seqs]
        if not batch:
            return []
        start = time.monotonic()
        time.sleep(self.step_s)
        outputs = []
        for r in batch:
            r.token_ids.append(RESPONSE_TOKEN)
            r.versions.append(self.weight_version)
            reason: FinishReason | None = None
            if len(r.token_ids) >= r.target:
                reason = "stop"
            elif len(r.token_ids) >= r.max_tokens:
                reason = "length"
            if reason is not None:
                del self._requests[r.request_id]
            outputs.append(StepOutput(r.request_id, r.group_id, [RESPONSE_TOKEN], [LOGPROB], [self.weight_version],
                                      reason is not None, reason, len(r.token_ids)))
        self.timeline.steps.append((start, time.monotonic(), len(batch)))
        self._note_if_idle()
        return outputs

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Record ``version``; the tensors are ignored.

        Raises:
            ValueError: ``version`` is not above the served one.
        """
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the served version {self.weight_version}")
        self.weight_version = version

    def close_timeline(self) -> Timeline:
        """The timeline, with an open idle interval closed now."""
        if self._idle_since is not None:
            self.timeline.idle.append((self._idle_since, time.monotonic()))
            self._idle_since = time.monotonic()
        return self.timeline


# ---- one generator process around it --------------------------------------------------------


async def serve(args: argparse.Namespace) -> int:
    """Run a real :class:`GeneratorActor` (DEALER socket, credit, heartbeats) around a FakeEngine;
    write the engine's timeline to ``args.timeline`` when it stops. Returns the actor's exit code."""

    from specroll.actors.config import load_config, toml_value
    from specroll.actors.generator.actor import GeneratorActor
    from specroll.actors.peer.trainer_channel import trainer_channel
    from specroll.engine.engine import Engine
    from specroll.protocol.messages import ToGenerator

    settings = {"generator.engine.max_num_seqs": args.max_num_seqs, "generator.stream_every_steps": args.stream_every,
                "generator.heartbeat_s": args.heartbeat_s, "generator.stats_s": args.stats_s,
                "network.heartbeat_timeout_s": args.trainer_timeout_s, "generator.linger_s": 0.5}
    config = load_config(None, [f"{key}={toml_value(value)}" for key, value in settings.items()])
    actor_id = args.actor_id or f"generator-{uuid.uuid4().hex}"
    engine = FakeEngine(args.step_s, args.max_num_seqs)
    try:
        async with trainer_channel(args.connect, actor_id, ToGenerator, config.network.window,
                                   config.generator.linger_s) as channel:
            code = await GeneratorActor(config, cast(Engine, engine), channel, connect=args.connect,
                                        actor_id=actor_id).run()
    finally:
        if args.timeline:
            engine.close_timeline().write(Path(args.timeline))
    return code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/fake_engine.py",
                                description="One generator actor serving a fixed-cost fake engine.")
    p.add_argument("--connect", required=True, help="the client's endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--actor-id", default="", help="unique id (default: generator-<uuid4 hex>)")
    p.add_argument("--step-s", type=float, default=0.02, help="seconds per engine step, any batch size")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests per step (the capacity)")
    p.add_argument("--stream-every", type=int, default=8, help="engine steps between chunks of a sample at most")
    p.add_argument("--heartbeat-s", type=float, default=0.2, help="seconds between heartbeats (capacity reports)")
    p.add_argument("--stats-s", type=float, default=1.0, help="seconds between Stats messages")
    p.add_argument("--trainer-timeout-s", type=float, default=30.0,
                   help="exit when the client has been unreachable this long")
    p.add_argument("--timeline", default="", help="write the engine's timeline (JSON) here on exit")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import anyio

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return anyio.run(serve, args, backend="asyncio")


def start_fake_generator(connect: str, *, actor_id: str, step_s: float, max_num_seqs: int, stream_every: int,
                         timeline: str, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start one fake generator process in its own process group (stop it with :func:`stop_processes`)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--connect", connect, "--actor-id", actor_id,
           "--step-s", str(step_s), "--max-num-seqs", str(max_num_seqs), "--stream-every", str(stream_every),
           "--timeline", timeline]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM each process group (the actor then flushes and exits 0), SIGKILL the group of any
    still running after ``grace_s``, and reap every child (groups are signalled only before their
    leader is reaped, so a reused pid is never hit)."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
