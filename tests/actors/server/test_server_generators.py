"""The server in front of two real generator processes: an ``X-Session-ID`` keeps a conversation
on one generator and moves it when that one dies; a generator SIGKILLed mid-request leaves the
request to finish on the other from the tokens already streamed (none repeated, none lost); a
weight update over HTTP in the middle of a request shows in ``token_versions`` at the token where
the new weights took over."""

from __future__ import annotations

import os
import signal

import httpx2 as httpx  # the HTTP client the openai package depends on
import openai
import pytest
from helpers.checkpoints import TOKEN_A, TOKEN_B, reveal_weights, write_tiny_checkpoint
from helpers.processes import wait_until
from helpers.server import HANG_S, served
from safetensors.torch import load_file, save_file

from specroll.protocol.messages import RolloutChunk

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

CONTEXT = 1024
DEATH_TIMEOUT_S = 2.0
"""The hub's heartbeat timeout in the death tests (a SIGKILL closes the connection at once anyway)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _api(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HANG_S)


def _record(s) -> list[tuple[str, RolloutChunk]]:
    """Every chunk the hub receives, with the generator that sent it (the server's own hook still runs)."""
    seen: list[tuple[str, RolloutChunk]] = []
    server_hook = s.client.on_chunk

    def hook(actor: str, chunk: RolloutChunk) -> None:
        seen.append((actor, chunk))
        server_hook(actor, chunk)

    s.client.on_chunk = hook
    return seen


def _kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the generator runs in its own process group


async def test_a_session_stays_on_one_generator_and_moves_when_it_dies(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    write_tiny_checkpoint(model, max_position_embeddings=CONTEXT)
    async with served(model, tmp_path, generators=2, heartbeat_timeout_s=DEATH_TIMEOUT_S) as s:
        seen = _record(s)
        api = _api(s.url)
        others: set[str] = set()  # group ids of requests that are not turns

        async def turns(session: str, count: int, messages: list[dict]) -> set[str]:
            start = len(seen)
            for turn in range(count):
                messages.append({"role": "user", "content": f"turn {turn}: go on"})
                reply = await api.chat.completions.create(
                    model=s.state.model_name, messages=messages, max_tokens=6, temperature=1.0,
                    extra_headers={"X-Session-ID": session})
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            return {actor for actor, chunk in seen[start:] if chunk.group_id not in others}

        histories: dict[str, list[dict]] = {f"s{i}": [] for i in range(3)}
        homes = {}
        for session, messages in histories.items():
            (homes[session],) = await turns(session, 1, messages)
        # A long request of s0 makes its generator the busier one (one sequence more), where a
        # request without a session would go elsewhere; s0's next turns still go there.
        home = homes["s0"]
        holder = await api.completions.create(
            model=s.state.model_name, prompt=[5, 6, 7], max_tokens=CONTEXT - 8, stream=True,
            extra_headers={"X-Session-ID": "s0"}, extra_body={"ignore_eos": True})
        await anext(aiter(holder))
        assert seen[-1][0] == home
        others.add(seen[-1][1].group_id)
        for session, messages in histories.items():
            assert await turns(session, 3, messages) == {homes[session]}, f"session {session} changed generator"
        await holder.close()
        # Each later turn's prompt starts with the earlier turns: its home generator's prefix cache has it.
        def hits() -> int:  # a generator is listed once its first Stats arrived
            stats = s.client.prefix_cache_stats().get(home)
            return 0 if stats is None else stats.cached_prompt_tokens

        await wait_until(lambda: hits() > 0, HANG_S,
                         "prefix-cache hits on the session's generator")

        survivor = ({"gen-0", "gen-1"} - {home}).pop()
        _kill(s.procs[home])
        await wait_until(lambda: home in s.client.dead_generators, HANG_S, f"the hub to declare {home} dead")
        for session, messages in histories.items():  # every session goes on, now all on the survivor
            assert await turns(session, 2, messages) == {survivor}
        await api.close()


async def test_a_generator_killed_mid_request_leaves_it_to_finish_on_the_other(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    write_tiny_checkpoint(model, max_position_embeddings=CONTEXT)
    max_tokens = CONTEXT - 24
    async with served(model, tmp_path, generators=2, heartbeat_timeout_s=DEATH_TIMEOUT_S) as s:
        seen = _record(s)
        api = _api(s.url)
        stream = await api.completions.create(
            model=s.state.model_name, prompt=[5, 6, 7, 8], max_tokens=max_tokens, temperature=1.0, seed=3,
            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        ids: list[int] = []
        versions: list[int] = []
        finish, killed = None, None
        async for event in stream:
            for choice in event.choices:
                ids += choice.model_extra["token_ids"]
                versions += choice.model_extra["token_versions"]
                finish = choice.finish_reason or finish
            if killed is None and ids:
                killed = seen[-1][0]  # the generator streaming this request
                _kill(s.procs[killed])
        (group,) = {c.group_id for _, c in seen}
        by_actor = {actor: [c for a, c in seen if a == actor] for actor, _ in seen}
        assert set(by_actor) == {"gen-0", "gen-1"}, "the request moved to the other generator"
        before, after = by_actor[killed], by_actor[({"gen-0", "gen-1"} - {killed}).pop()]
        streamed = sum(len(c.token_ids) for c in before)
        assert streamed < max_tokens, "the generator died mid-request"
        # The survivor went on from exactly the tokens the dead one had streamed ...
        assert after[0].offset == streamed
        held = [t for c in before for t in c.token_ids] + [t for c in after for t in c.token_ids]
        # ... and the client got each token once: the request completes with max_tokens tokens.
        assert ids == held and len(ids) == max_tokens and finish == "length"
        assert versions == [0] * max_tokens
        assert killed in s.client.dead_generators and group not in s.state.router.live
        await api.close()


async def test_a_weight_update_mid_request_changes_token_versions_at_the_token_it_took_over(tmp_path):
    model = tmp_path / "reveal"
    model.mkdir()
    write_tiny_checkpoint(model, "llama", tie_word_embeddings=False, max_position_embeddings=CONTEXT)
    head_b = reveal_weights(model)  # weights A emit only TOKEN_A, weights B only TOKEN_B
    async with served(model, tmp_path, generators=2) as s:
        weights_b = {**load_file(model / "model.safetensors"), **head_b}
        (s.weights_dir / "b").mkdir()
        save_file(weights_b, s.weights_dir / "b" / "model.safetensors")
        api = _api(s.url)
        stream = await api.completions.create(
            model=s.state.model_name, prompt=[7, 8, 9], max_tokens=CONTEXT - 8, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        ids: list[int] = []
        versions: list[int] = []
        async with httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S) as http:
            update = None
            async for event in stream:
                for choice in event.choices:
                    ids += choice.model_extra["token_ids"]
                    versions += choice.model_extra["token_versions"]
                if update is None and ids:
                    update = await http.post("/update_weights", json={"path": "b"})  # waits until served
                    assert update.status_code == 200 and update.json() == {"policy_version": 1}
                if versions.count(1) >= 8:
                    break  # leaving the stream disconnects: the rest of the request is aborted
            await stream.close()
        # Each token's version is that of the weights that produced it: A ⇔ 0, B ⇔ 1 ...
        assert [{0: TOKEN_A, 1: TOKEN_B}[v] for v in versions] == ids
        # ... and it changes once, mid-request, from 0 to 1.
        assert versions == sorted(versions) and versions[0] == 0
        await wait_until(lambda: not s.state.router.live, HANG_S, "the request to be aborted")
        models = (await api.models.list()).data
        assert models[0].model_extra["policy_versions"] == {"gen-0": 1, "gen-1": 1}
        await api.close()
