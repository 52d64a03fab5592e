"""The specroll side of ``bench_server.py``: one hub, its OpenAI-compatible server and a generator
process (:func:`specroll_stack`, built as ``specroll serve`` builds them: ``client_from_config``,
``make_state``, ``bind``, ``serve_http``), and the two ways a cell loads them — the HTTP arms through a
client process running ``server_load.py`` (:func:`http_cell`, also used for ``vllm serve``) and the
direct arm straight through :class:`~specroll.actors.rollout.client.RolloutClient` in this process
(:class:`HubWatch`), both against that one generator.
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream
from server_load import Cell, Job, Sample, cpu_s, drive

from specroll.actors.config import load_config, write_resolved
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.from_config import client_from_config
from specroll.actors.server.serving import bind, make_state, serve_http, url_of
from specroll.engine.loaders.checkpoint import load_metadata
from specroll.protocol.messages import RolloutChunk
from specroll.protocol.sampling import SamplingParams

LOAD_SCRIPT = Path(__file__).resolve().with_name("server_load.py")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CpuMeter = Callable[[], tuple[float, float | None]]
"""CPU seconds used so far by ``(the server, the engine)``; the engine None where it is not apart."""


def _group(pgid: int) -> list[list[str]]:
    """The ``/proc/PID/stat`` fields (after the command) of the processes in process group ``pgid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.append(fields)
    return found


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes in process group ``pgid`` (from ``/proc``)."""
    return sum(int(f[11]) + int(f[12]) for f in _group(pgid)) / _CLOCK_TICKS  # utime, stime (fields 14, 15)


@contextlib.contextmanager
def process_group(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` in its own session (so process group), output to ``log``; on the way out the whole
    group gets SIGTERM, then SIGKILL after 20 s, until none of it runs. The leader is reaped only
    then: unreaped, its pid (the group's id) cannot be reused, so the group signalled is always ours."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        yield proc
    finally:
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 30.0)):
            if not _running(proc.pid):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + wait_s
            while _running(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        proc.wait()


def _running(pgid: int) -> bool:
    return any(fields[0] != "Z" for fields in _group(pgid))


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


@dataclass
class Stack:
    """A running hub + server + generator."""

    client: RolloutClient
    url: str
    model_name: str
    generator: subprocess.Popen[bytes]

    def cpu(self) -> tuple[float, float | None]:
        """(this process, the generator's process group): CPU seconds so far."""
        return cpu_s(), group_cpu_s(self.generator.pid)


@contextlib.asynccontextmanager
async def specroll_stack(overrides: list[str], run_dir: Path, actor_id: str, hang_s: float) -> AsyncIterator[Stack]:
    """The hub and the server in this event loop and one generator process started from the same
    resolved run config (``RUN_DIR/config.toml``), until the generator is connected and ready.

    Raises:
        RuntimeError: the generator exited or was not ready within ``hang_s`` (with its log's tail).
    """
    config = load_config(None, [*overrides, f'run_dir="{run_dir}"'])
    config_path = write_resolved(config)
    model, tokenizer = load_metadata(config.model.name)
    log = run_dir / f"{actor_id}.log"
    async with client_from_config(config, None) as client:
        state = make_state(config, client, tokenizer, model, None)
        sock = bind(config.server)
        cmd = [sys.executable, "-m", "specroll.actors.generator", "--connect", client.endpoint, "--config",
               str(config_path), "--actor-id", actor_id]
        with process_group(cmd, log) as generator:
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve_http, state, sock)
                deadline = time.monotonic() + hang_s
                while True:
                    with anyio.move_on_after(0.5) as waiting:
                        await client.wait_for_generators(1)
                    if not waiting.cancelled_caught:
                        break
                    if generator.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the generator {'exited' if generator.poll() is not None else 'hung'} "
                                           f"before it was ready:\n{log_tail(log)}")
                yield Stack(client, url_of(sock), state.model_name, generator)
                tg.cancel_scope.cancel()


@contextlib.contextmanager
def profiling(profile: cProfile.Profile | None) -> Iterator[None]:
    if profile is not None:
        profile.enable()
    try:
        yield
    finally:
        if profile is not None:
            profile.disable()


class HubWatch:
    """Every group's times in the hub (``time.perf_counter()`` seconds): when it was submitted, when its
    first chunk with tokens and its last chunk arrived — for the HTTP arms' requests (submitted by the
    server's router) and the direct arm's alike — and the direct arm's requests: ``submit`` a group of
    one sample in the ``serve`` lane (as the router does) and wait for it in the hub's chunk
    callback, no HTTP, no text.

    It wraps this hub's ``submit`` and chains its chunk callback (the router still sees every chunk).
    """

    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.submitted: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self._waiting: dict[str, anyio.Event] = {}
        submit, before = client.submit, client.on_chunk

        async def timed_submit(*args: Any, **kwargs: Any) -> str:
            at = time.perf_counter()
            group_id = await submit(*args, **kwargs)
            self.submitted[group_id] = at
            return group_id

        def on_chunk(actor: str, chunk: RolloutChunk) -> None:
            if before is not None:
                before(actor, chunk)
            now = time.perf_counter()
            if chunk.token_ids:
                self.first.setdefault(chunk.group_id, now)
            if chunk.finished:
                self.done[chunk.group_id] = now
                if (event := self._waiting.get(chunk.group_id)) is not None:
                    event.set()

        client.submit, client.on_chunk = timed_submit, on_chunk  # type: ignore[method-assign]

    def place(self, sample: Sample) -> None:
        """Set ``sample``'s ``hub_s`` and ``server_s`` from the one group submitted while it was in flight
        (nothing where there was not exactly one: requests overlapped)."""
        end = sample.sent_s + sample.latency_s
        inside = [g for g, at in self.submitted.items() if sample.sent_s <= at <= end and g in self.done]
        if len(inside) != 1:
            return
        submitted, done = self.submitted[inside[0]], self.done[inside[0]]
        sample.hub_s = done - submitted
        if sample.build_s is not None and sample.reply_s is not None:
            sample.server_s = (submitted - sample.sent_s - sample.build_s) + (sample.sent_s + sample.reply_s - done)

    def forget(self) -> None:
        self.submitted.clear()
        self.first.clear()
        self.done.clear()

    async def request(self, prompt: list[int], sampling: SamplingParams) -> Sample:
        """One direct request."""
        start = time.perf_counter()
        group_id = await self.client.submit(prompt, 1, sampling, lane="serve")
        group = self.client.coordinator.groups.get(group_id)
        done = self._waiting[group_id] = anyio.Event()
        try:
            if group_id not in self.done:
                await done.wait()
        finally:
            del self._waiting[group_id]
        latency = time.perf_counter() - start
        assert group is not None and group.finished, group_id
        first = self.first.get(group_id)
        return Sample(start, latency, None if first is None else first - start, len(group.samples[0].token_ids),
                      len(prompt), self.done[group_id] - self.submitted[group_id])


async def direct_cell(arm: HubWatch, job: Job, cpu: CpuMeter, hang_s: float,
                      profile: cProfile.Profile | None = None) -> Cell:
    """``job`` (its prompts as token ids) through :meth:`HubWatch.request`, after the same warm-up as the
    HTTP client's: one 1-token request per concurrent slot; ``profile`` records the timed stretch."""
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=job.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=1, ignore_eos=True)
    prompts = job.prompts
    with anyio.fail_after(hang_s):
        await drive(job.concurrency, job.concurrency, lambda i: arm.request(prompts[i % len(prompts)], warm))
        server0, engine0 = cpu()
        with profiling(profile):
            samples, wall = await drive(job.count, job.concurrency,
                                        lambda i: arm.request(prompts[i % len(prompts)], sampling))
        server1, engine1 = cpu()
    arm.forget()
    return Cell(job.arm, job.concurrency, job.round, wall, samples, client_cpu_s=None, server_cpu_s=server1 - server0,
                engine_cpu_s=None if engine0 is None or engine1 is None else engine1 - engine0)


async def http_cell(job: Job, workdir: Path, cpu: CpuMeter, hang_s: float, watch: HubWatch | None = None,
                    profile: cProfile.Profile | None = None) -> Cell:
    """``job`` through a client process (``server_load.py``); the servers' CPU time is sampled when
    it says its timed stretch starts and ends, ``profile`` (this process: specroll's server) records
    just that stretch, and each request's hub time is read from ``watch`` (specroll's server) where
    one group alone was submitted while it was in flight (at concurrency 1).

    Raises:
        RuntimeError: the client process failed (with its output's tail).
    """
    name = f"{job.arm}-c{job.concurrency}-r{job.round}"
    job_path, log = workdir / f"job-{name}.json", workdir / "load.log"
    job_path.write_text(json.dumps(asdict(job)))
    marks: dict[str, tuple[float, float | None]] = {}
    result: dict[str, object] | None = None
    with open(log, "ab") as err, anyio.fail_after(hang_s):
        async with await anyio.open_process([sys.executable, str(LOAD_SCRIPT), str(job_path)], stderr=err) as proc:
            assert proc.stdout is not None
            lines = BufferedByteReceiveStream(proc.stdout)
            while True:
                try:
                    line = await lines.receive_until(b"\n", 64 << 20)
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    break
                event = json.loads(line)
                kind = event.pop("event")
                if kind in ("start", "end"):
                    if profile is not None:
                        profile.enable() if kind == "start" else profile.disable()
                    marks[kind] = cpu()
                elif kind == "result":
                    result = event
            code = await proc.wait()
    if code != 0 or result is None or set(marks) != {"start", "end"}:
        raise RuntimeError(f"{name}: the client process exited with {code}:\n{log_tail(log)}")
    cell = Cell.from_json(result)
    (s0, e0), (s1, e1) = marks["start"], marks["end"]
    cell.server_cpu_s = s1 - s0
    cell.engine_cpu_s = None if e0 is None or e1 is None else e1 - e0
    if watch is not None:
        if job.concurrency == 1:  # where each request's window holds its own submit alone
            for sample in cell.samples:
                watch.place(sample)
        watch.forget()
    return cell
