"""The server's refusals and its behaviour under load, in front of a real generator process: every bad
input answered with its status and OpenAI's error body (``{"error": {"message", "type", "param",
"code"}}``, the message naming the bad value), 429 past ``server.max_requests_in_flight``, 503 without
a generator, 401 without the key, and clients that go away, send slowly or send a lot."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx2 as httpx  # the HTTP client the openai package depends on
import pytest
from helpers.checkpoints import write_tiny_checkpoint
from helpers.processes import wait_until
from helpers.server import HANG_S, Served, served

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

CONTEXT = 4096
"""The test model's context: long enough that an ``ignore_eos`` stream outlives every check made on it."""
PROMPT = [5, 6, 7, 8, 9]
LONG = {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT), "ignore_eos": True}
"""A request that runs until the test ends it."""
SHORT = {"prompt": PROMPT, "max_tokens": 2}
TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
         408: "RequestTimeoutError", 413: "PayloadTooLargeError", 429: "RateLimitError",
         503: "ServiceUnavailableError"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("long-llama")
    write_tiny_checkpoint(path, max_position_embeddings=CONTEXT)
    return path


def _http(s: Served, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S, headers=headers)


def _check(r: httpx.Response, status: int, param: str | None, *needles: str) -> dict:
    """``r`` is OpenAI's error body with ``status``, ``param`` and a message holding every needle."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    return _check_body(r.json(), status, param, *needles)


def _check_body(body: dict, status: int, param: str | None, *needles: str) -> dict:
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["type"] == TYPES[status] and error["param"] == param, error
    assert isinstance(error["message"], str) and all(n in error["message"] for n in needles), error
    assert error["code"] is not None, error
    return error


async def _chunked(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:  # an iterator: httpx sends it chunked, without Content-Length
        yield part


async def _raw(s: Served) -> anyio.abc.SocketStream:
    url = httpx.URL(s.url)
    return await anyio.connect_tcp(url.host, url.port)


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def _read_reply(stream: anyio.abc.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 reply with a Content-Length: status, headers, body."""
    data = b""
    with anyio.fail_after(HANG_S):
        while b"\r\n\r\n" not in data:
            data += await stream.receive()
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        while len(body) < int(headers["content-length"]):
            body += await stream.receive()
    return int(status_line.split()[1]), headers, body


async def test_bad_requests_are_answered_with_their_status_and_the_field_at_fault(model, tmp_path):
    async with served(model, tmp_path, overrides=("server.max_n=2", "server.max_body_bytes=16384")) as s:
        name = s.state.model_name
        bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "nonsense"}}}}}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        cases = [  # (what, method, path, request, status, param, words of the message)
            ("malformed JSON", "POST", "/v1/completions", {"content": b'{"prompt": [5, 6'}, 400, None,
             ("not valid JSON",)),
            ("no body", "POST", "/v1/completions", {}, 400, None, ("not valid JSON",)),
            ("bytes that are no UTF-8", "POST", "/v1/completions", {"content": b'{"prompt": "\xff"}'}, 400, None,
             ("not valid JSON",)),
            ("JSON that is no object", "POST", "/v1/chat/completions", {"json": [chat]}, 400, None,
             ("object", "array")),
            ("a string for an int", "POST", "/v1/completions", {"json": {**SHORT, "max_tokens": "two"}}, 400,
             "max_tokens", ("int", "str", "max_tokens")),
            ("a nested wrong type", "POST", "/v1/chat/completions",
             {"json": {**chat, "messages": [{"role": 5, "content": "hi"}]}}, 400, "messages[0].role",
             ("str", "int", "messages[0].role")),
            ("a missing field", "POST", "/v1/completions", {"json": {"max_tokens": 2}}, 400, None, ("prompt",)),
            ("another model", "POST", "/v1/completions", {"json": {**SHORT, "model": "gpt-nope"}}, 404, "model",
             ("'gpt-nope'", repr(name))),
            ("another model, chat", "POST", "/v1/chat/completions", {"json": {**chat, "model": "gpt-nope"}}, 404,
             "model", ("'gpt-nope'",)),
            ("past the context", "POST", "/v1/completions", {"json": {**SHORT, "max_tokens": CONTEXT}}, 400,
             "max_tokens", (f"max_tokens = {CONTEXT}", f"{len(PROMPT)} + {CONTEXT}", str(CONTEXT - len(PROMPT)))),
            ("a prompt as long as the context", "POST", "/inference/v1/generate",
             {"json": {"token_ids": [5] * CONTEXT}}, 400, "token_ids", (f"{CONTEXT} tokens",)),
            ("n past server.max_n", "POST", "/v1/completions", {"json": {**SHORT, "n": 3}}, 400, "n",
             ("n = 3", "[1, 2]", "server.max_n")),
            ("n of 0", "POST", "/v1/chat/completions", {"json": {**chat, "n": 0}}, 400, "n", ("n = 0",)),
            ("a body over server.max_body_bytes", "POST", "/v1/completions",
             {"json": {**SHORT, "prompt": "x" * 20000}}, 413, None, ("at most 16384", "server.max_body_bytes")),
            ("a chunked body over it", "POST", "/v1/completions",
             {"content": _chunked(b'{"prompt": "', b"x" * 9000, b"y" * 9000, b'"}')}, 413, None,
             ("over 16384", "server.max_body_bytes")),
            ("parameters that are no JSON Schema", "POST", "/v1/chat/completions",
             {"json": {**chat, "tools": [bad_tool]}}, 400, "tools[0].function.parameters", ("'nonsense'",)),
            ("a token id out of the vocabulary", "POST", "/v1/completions",
             {"json": {**SHORT, "prompt": [5, 6, 99999]}}, 400, "prompt", ("prompt[2] = 99999", "[0, 320)")),
            ("a negative token id in a batch", "POST", "/v1/completions",
             {"json": {**SHORT, "prompt": [[5, 6], [7, -1]]}}, 400, "prompt[1]", ("prompt[1][1] = -1",)),
            ("a token id out of the vocabulary, generate", "POST", "/inference/v1/generate",
             {"json": {"token_ids": [320]}}, 400, "token_ids", ("token_ids[0] = 320",)),
            ("an unknown route", "GET", "/v1/engines", {}, 404, None, ("GET /v1/engines",)),
            ("an unknown POST route", "POST", "/v1/embeddings", {"json": {}}, 404, None, ("POST /v1/embeddings",)),
            ("the wrong method", "GET", "/v1/completions", {}, 405, None, ("GET", "/v1/completions")),
            ("the wrong method, chat", "DELETE", "/v1/chat/completions", {}, 405, None, ("DELETE",)),
        ]
        async with _http(s) as http:
            for what, method, path, request, status, param, words in cases:
                r = await http.request(method, path, **request)
                assert (what, r.status_code) == (what, status), r.text
                _check(r, status, param, *words)
                assert r.headers.get("allow") == ("POST" if status == 405 else None)
                assert (r.headers.get("connection") == "close") == (status == 413)  # the rest is not read
            # Nothing reached the hub, and the server still answers.
            assert s.state.router.requests_total == 0
            assert (await http.post("/v1/completions", json=SHORT)).status_code == 200


async def test_past_max_requests_in_flight_a_request_is_answered_429_with_retry_after(model, tmp_path):
    async with served(model, tmp_path, overrides=("server.max_requests_in_flight=1",)) as s, _http(s) as http:
        async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as held:
            assert held.status_code == 200
            lines = held.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # generating, and in flight until it is closed
            for stream in (False, True):
                r = await http.post("/v1/completions", json={**SHORT, "stream": stream})
                error = _check(r, 429, None, "1 requests in flight", "server.max_requests_in_flight")
                assert r.headers["retry-after"] == "1" and error["code"] == "too_many_requests"
            assert s.state.router.rejected_total == 2
        await wait_until(lambda: not s.state.router.live, HANG_S, "the held stream to end")
        assert (await http.post("/v1/completions", json=SHORT)).status_code == 200


async def test_without_a_generator_requests_and_health_are_answered_503(model, tmp_path):
    async with served(model, tmp_path, generators=0) as s, _http(s) as http:
        for stream in (False, True):
            r = await http.post("/v1/completions", json={**SHORT, "stream": stream})
            error = _check(r, 503, None, "no generator")
            assert r.headers["retry-after"] == "5" and error["code"] == "no_generator"
        r = await http.get("/health")
        _check(r, 503, None, "no generator")
        assert r.headers["retry-after"] == "5"
        assert (await http.post("/tokenize", json={"prompt": "hi"})).status_code == 200  # no generation needed


async def test_with_an_api_key_every_route_but_health_needs_it(model, tmp_path):
    async with served(model, tmp_path, overrides=('server.api_key="sekrit"',)) as s:
        for headers in ({}, {"Authorization": "Bearer guess"}, {"Authorization": "Basic sekrit"},
                        {"Authorization": "sekrit"}, {"Authorization": "Bearer sekrit2"}):
            async with _http(s, **headers) as http:
                for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", SHORT),
                                           ("POST", "/pause", None)):
                    r = await http.request(method, path, json=body)
                    error = _check(r, 401, None, "API key", "Bearer")
                    assert error["code"] == "invalid_api_key"
                    assert "guess" not in error["message"] and "sekrit" not in error["message"]  # no key echoed
                assert (await http.get("/health")).status_code == 200
        assert s.state.router.requests_total == 0 and not s.state.router.paused
        async with _http(s, Authorization="Bearer sekrit") as http:
            assert (await http.get("/v1/models")).status_code == 200
            assert (await http.post("/v1/completions", json=SHORT)).status_code == 200


async def test_a_client_going_away_aborts_its_request_and_frees_the_generator(model, tmp_path):
    async with served(model, tmp_path) as s, _http(s) as http:
        router, load = s.state.router, s.client.peers.load

        async def generating() -> object:
            await wait_until(lambda: router.live, HANG_S, "the request to reach the hub")
            (generation,) = router.live.values()
            await wait_until(lambda: load["gen-0"][0] == 2 and all(x.token_ids for x in generation.group.samples),
                             HANG_S, "the generator to run both samples")
            return generation

        async def gone(generation: object) -> None:
            await wait_until(lambda: not router.live and generation.group_id not in s.client.coordinator.groups,
                             HANG_S, "the request to be aborted")
            await wait_until(lambda: load["gen-0"][0] == 0, HANG_S, "the generator to free its sequences")
            # Aborted, not run to its end.
            assert all(x.finish_reason is None and len(x.token_ids) < LONG["max_tokens"]
                       for x in generation.group.samples)

        async with http.stream("POST", "/v1/completions", json={**LONG, "n": 2, "stream": True}) as r:
            assert r.status_code == 200
            generation = await generating()
        await gone(generation)  # the stream was closed mid-way
        async with anyio.create_task_group() as tg:  # and a whole reply that is no longer waited for
            tg.start_soon(functools.partial(http.post, "/v1/completions", json={**LONG, "n": 2}))
            generation = await generating()
            tg.cancel_scope.cancel()
        await gone(generation)
        assert (await http.post("/v1/completions", json=SHORT)).status_code == 200


async def test_a_body_sent_too_slowly_is_answered_408_while_others_are_served(model, tmp_path):
    async with served(model, tmp_path, overrides=("server.body_timeout_s=1",)) as s, _http(s) as http:
        slow = await _raw(s)
        body = json.dumps(SHORT).encode()
        await slow.send(_head("/v1/completions", len(body)) + body[:10])  # then nothing
        r = await http.post("/v1/completions", json=SHORT)  # meanwhile
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        status, headers, reply = await _read_reply(slow)
        assert (status, headers["content-type"], headers["connection"]) == (408, "application/json", "close")
        error = _check_body(json.loads(reply), 408, None, "1.0 s", "server.body_timeout_s")
        assert error["code"] == "body_timeout"
        with anyio.fail_after(HANG_S), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
            await slow.receive()  # and dropped
        await slow.aclose()
        assert s.state.router.requests_total == 1


async def test_clients_that_send_their_headers_too_slowly_are_dropped_and_free_the_server(model, tmp_path):
    # uvicorn answers 503 beyond server.max_requests_in_flight + 64 connections: 65 clients that never
    # finish their headers would hold every slot, but each is dropped after server.body_timeout_s.
    overrides = ("server.body_timeout_s=1", "server.max_requests_in_flight=1")
    async with served(model, tmp_path, overrides=overrides) as s, _http(s) as http:
        slow = [await _raw(s) for _ in range(65)]
        for stream in slow:
            await stream.send(b"POST /v1/completions HTTP/1.1\r\nHost: te")  # then nothing
        for stream in slow:
            with anyio.fail_after(HANG_S), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await stream.receive()  # closed, with nothing to answer
            await stream.aclose()
        assert (await http.post("/v1/completions", json=SHORT)).status_code == 200
        assert s.state.router.requests_total == 1


async def test_a_huge_body_does_not_hold_up_other_requests(model, tmp_path):
    async with served(model, tmp_path) as s, _http(s) as http:
        # A large body but its last byte: the server waits for it, serving others meanwhile.
        big = json.dumps({**SHORT, "prompt": "word " * 600_000}).encode()
        huge = await _raw(s)
        await huge.send(_head("/v1/completions", len(big)) + big[:-1])
        assert (await http.post("/v1/completions", json=SHORT)).status_code == 200
        # The text is tokenized off the event loop: held inside the tokenizer until a request sent after it
        # has been answered, which needs the loop (and the hub) free meanwhile.
        answered = threading.Event()
        encode = s.state.tokenizer.encode

        def gated_encode(text: str, *args, **kwargs) -> list[int]:
            if len(text) > 1_000_000:
                answered.wait(60)  # a hang guard: the order below is what is checked
            return encode(text, *args, **kwargs)

        s.state.tokenizer.encode = gated_encode
        await huge.send(big[-1:])
        order = []

        async def huge_reply() -> None:
            order.append(await _read_reply(huge))

        async with anyio.create_task_group() as tg:
            tg.start_soon(huge_reply)
            order.append(await http.post("/v1/completions", json=SHORT))
            answered.set()
        assert isinstance(order[0], httpx.Response) and order[0].status_code == 200
        status, _, reply = order[1]
        assert status == 400
        _check_body(json.loads(reply), 400, "prompt", f"this model's context is {CONTEXT} tokens")
        await huge.aclose()


async def test_a_request_its_generator_refuses_is_answered_400_at_once(model, tmp_path):
    # The generator runs with a shorter context than the server knows of (started by hand with other
    # flags): it refuses the group, and the request ends now instead of at server.request_timeout_s.
    async with served(model, tmp_path, generator_args=("--max-model-len", "64")) as s, _http(s) as http:
        for stream in (False, True):
            with anyio.fail_after(HANG_S):
                r = await http.post("/v1/completions", json={**SHORT, "prompt": [5] * 100, "stream": stream})
            # the generator's own limit (max_model_len 64 - 1), not the server's: a bare "64" matched
            # only when the group id happened to contain it
            error = _check(r, 400, None, "the generator refused this request", "over the limit 63 (max_model_len")
            assert error["code"] == "refused_by_generator"
        assert not s.state.router.live and not s.client.coordinator.groups
        assert (await http.post("/v1/completions", json=SHORT)).status_code == 200
