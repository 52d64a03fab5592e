"""The load of ``bench_server.py``: the same requests sent at a fixed concurrency, closed loop (each of
``concurrency`` workers sends its next request when its last one finished), timed per request.

:func:`drive` runs any one-request coroutine that way; :func:`openai_request` is one request through
the real ``openai`` package (``AsyncOpenAI``) to an OpenAI-compatible server — specroll's or ``vllm
serve`` — in one of :data:`MODES`: completions with the prompt as token ids, or chat with the
messages; whole replies or streamed (server-sent events). Every request asks for exactly
``max_tokens`` tokens (``ignore_eos``) at temperature 1, so every arm does the same work.

Run as a script (``python server_load.py JOB.json``) it is the client process of an HTTP arm: it
warms its client up, prints ``{"event": "start"}``, runs the job, prints ``{"event": "end"}`` and then
the measured :class:`Cell` as ``{"event": "result", ...}`` (one JSON object a line), so the parent can
sample the servers' CPU time over exactly the timed stretch.
"""

from __future__ import annotations

import contextvars
import json
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

MODES = ("completions", "completions-stream", "chat", "chat-stream")
"""The HTTP request kinds: ``/v1/completions`` (token-id prompt) and ``/v1/chat/completions``, whole or streamed."""
TIMEOUT_S = 900.0
"""One request's limit in the client: a hang guard only."""


@dataclass
class Sample:
    """One request: when it was sent (``time.perf_counter()``: CLOCK_MONOTONIC, the same clock in every
    process here), its latency (seconds from sending to the whole reply), time to its first token
    (streamed requests and the direct arm; None otherwise), the token counts its reply reports, and
    ``hub_s``: the seconds its group spent in the hub, from ``submit`` to its last chunk (set by the
    parent where it can tell which group was this request's; None otherwise)."""

    sent_s: float
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    prompt_tokens: int
    hub_s: float | None = None
    build_s: float | None = None
    """HTTP arms: seconds from the call to the request going on the wire (the client's own request
    building: ``openai``'s validation and ``httpx``'s request, before the server sees a byte)."""
    reply_s: float | None = None
    """HTTP arms: seconds from the call to the reply's last token reaching the client: the whole body of
    a whole reply (read in httpx's response hook, before ``openai`` parses it), a stream's event with
    the finish reason."""
    server_s: float | None = None
    """Where ``hub_s`` is known: the server's share of the time outside the hub — from the request going
    on the wire to its ``submit``, and from its last chunk to the reply's last token at the client (each
    with one loopback hop); the rest outside the hub is the client's (``build_s``, then reading the reply)."""


@dataclass
class Cell:
    """One arm at one concurrency in one round: every request's figures and the CPU seconds spent,
    over the timed stretch, by the client process (HTTP arms), the server (specroll's process with the
    hub; vLLM's API server with its engine) and specroll's generator."""

    arm: str
    concurrency: int
    round: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    client_cpu_s: float | None = None
    server_cpu_s: float | None = None
    engine_cpu_s: float | None = None

    @property
    def requests(self) -> int:
        return len(self.samples)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Cell:
        samples = [Sample(**s) for s in d.pop("samples")]
        return Cell(**d, samples=samples)


@dataclass
class Job:
    """What one client process runs (written by the parent as JSON)."""

    url: str
    """Base URL, ``http://HOST:PORT/v1``."""
    model: str
    mode: str
    concurrency: int
    count: int
    """Requests in the timed stretch; request ``i`` is prompt ``i % len(prompts)``."""
    max_tokens: int
    prompts: list[list[int]]
    """Each prompt as token ids (the chat template applied): the completions modes send these."""
    messages: list[list[dict[str, str]]]
    """The same prompts as chat messages: the chat modes send these (the server applies the template)."""
    arm: str = ""
    round: int = 0


async def drive(count: int, concurrency: int, one: Callable[[int], Awaitable[Sample]]) -> tuple[list[Sample], float]:
    """Run ``one(0) .. one(count - 1)`` with ``concurrency`` requests in flight (closed loop).

    Returns:
        The samples in request order and the wall time (seconds) from the first send to the last reply.
    """
    samples: list[Sample | None] = [None] * count
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            i, next_index = next_index, next_index + 1
            samples[i] = await one(i)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, count)):
            tg.start_soon(worker)
    wall = time.perf_counter() - start
    assert all(s is not None for s in samples)
    return samples, wall  # type: ignore[return-value]


async def openai_request(client: Any, job: Job, i: int, max_tokens: int | None = None) -> Sample:
    """Request ``i`` of ``job`` through ``client`` (an ``openai.AsyncOpenAI``), in ``job.mode``.

    Raises:
        openai.APIError: the server refused or failed it.
        RuntimeError: the reply carried no usage.
    """
    stream = job.mode.endswith("-stream")
    chat = job.mode.startswith("chat")
    common: dict[str, Any] = {"model": job.model, "max_tokens": max_tokens or job.max_tokens, "temperature": 1.0,
                              "top_p": 1.0, "extra_body": {"ignore_eos": True}, "timeout": TIMEOUT_S}
    if stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    k = i % len(job.prompts)
    wire: list[float] = []  # [on the wire, a whole reply's body in]
    _ON_WIRE.set(wire)
    start = time.perf_counter()
    if chat:
        reply = await client.chat.completions.create(messages=job.messages[k], **common)
    else:
        reply = await client.completions.create(prompt=job.prompts[k], **common)
    ttft, usage, last = None, None, None
    if stream:
        async for chunk in reply:
            if chunk.choices:
                c = chunk.choices[0]
                if ttft is None and (c.delta.content if chat else c.text):  # not vLLM's role-only first chunk
                    ttft = time.perf_counter() - start
                if c.finish_reason is not None:
                    last = time.perf_counter() - start
            usage = chunk.usage or usage
    else:
        usage = reply.usage
        last = wire[1] - start if len(wire) > 1 else None
    latency = time.perf_counter() - start
    if usage is None:
        raise RuntimeError(f"{job.mode} request {i}: the reply carried no usage")
    return Sample(start, latency, ttft, usage.completion_tokens, usage.prompt_tokens,
                  build_s=wire[0] - start if wire else None, reply_s=last)


_ON_WIRE: contextvars.ContextVar[list[float]] = contextvars.ContextVar("on_wire")
"""The running request's times on the wire: sent, a whole reply's body in (httpx's hooks run in its task)."""


async def _on_request(_: object) -> None:
    if (times := _ON_WIRE.get(None)) is not None:
        times.append(time.perf_counter())


async def _on_response(response: Any) -> None:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return  # a stream's end is its last event (openai_request)
    await response.aread()  # the body, as openai would read it next; then only parsing is left
    await _on_request(response)


def cpu_s() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


async def run_job(job: Job) -> Cell:
    """Warm a client up (one short request per connection it will open), then time ``job``."""
    import openai

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [_on_request], "response": [_on_response]})
    client = openai.AsyncOpenAI(base_url=job.url, api_key="bench", max_retries=0, http_client=http)
    async with client:
        await drive(job.concurrency, job.concurrency, lambda i: openai_request(client, job, i, max_tokens=1))
        emit({"event": "start"})
        cpu = cpu_s()
        samples, wall = await drive(job.count, job.concurrency, lambda i: openai_request(client, job, i))
        cpu = cpu_s() - cpu
        emit({"event": "end"})
    return Cell(job.arm or job.mode, job.concurrency, job.round, wall, samples, client_cpu_s=cpu)


def summary(cells: list[Cell]) -> dict[str, float | None]:
    """Pooled figures of one arm at one concurrency over its rounds: requests/s (all requests over
    all timed wall time), mean and median latency and time to first token (ms), the mean time a request
    spent outside the hub (latency minus ``hub_s``, ms: the HTTP layer's and client's share, paired per
    request), the client's request building and the server's share of it (ms), CPU ms a request."""
    samples = [s for c in cells for s in c.samples]
    wall = sum(c.wall_s for c in cells)
    lat = [s.latency_s * 1e3 for s in samples]
    ttft = [s.ttft_s * 1e3 for s in samples if s.ttft_s is not None]
    outside = [(s.latency_s - s.hub_s) * 1e3 for s in samples if s.hub_s is not None]
    build = [s.build_s * 1e3 for s in samples if s.build_s is not None and s.hub_s is not None]
    server = [s.server_s * 1e3 for s in samples if s.server_s is not None]

    def per_request(name: str) -> float | None:
        values = [getattr(c, name) for c in cells]
        return None if any(v is None for v in values) else 1e3 * sum(values) / len(samples)

    return {"requests": len(samples), "requests_per_s": len(samples) / wall,
            "tokens_per_s": sum(s.completion_tokens for s in samples) / wall,
            "latency_ms_mean": statistics.fmean(lat), "latency_ms_median": statistics.median(lat),
            "latency_ms_se": statistics.stdev(lat) / len(lat) ** 0.5 if len(lat) > 1 else None,
            "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
            "ttft_ms_median": statistics.median(ttft) if ttft else None,
            "outside_hub_ms_mean": statistics.fmean(outside) if outside else None,
            "outside_hub_ms_median": statistics.median(outside) if outside else None,
            "outside_hub_requests": len(outside), "client_build_ms_mean": statistics.fmean(build) if build else None,
            "server_share_ms_mean": statistics.fmean(server) if server else None,
            "prompt_tokens_mean": statistics.fmean(s.prompt_tokens for s in samples),
            "client_cpu_ms": per_request("client_cpu_s"), "server_cpu_ms": per_request("server_cpu_s"),
            "engine_cpu_ms": per_request("engine_cpu_s")}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python server_load.py JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = Job(**json.load(f))
    if job.mode not in MODES:
        print(f"server_load.py: mode {job.mode!r}; expected one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    cell = anyio.run(run_job, job)
    emit({"event": "result", **cell.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
