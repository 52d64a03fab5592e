"""The server through the real ``openai`` package (async and sync clients, streaming and not) in
front of a real generator process: completions with text and token-id prompts, chat with and
without tools, a tool call parsed from what a model trained in the test says, ``n > 1``, ``seed``,
``return_token_ids`` round trips, logprobs equal to a ``RolloutClient`` rollout's, and a weight
update over HTTP seen in ``token_versions``."""

from __future__ import annotations

import json

import anyio
import httpx2 as httpx  # the HTTP client the openai package depends on
import openai
import pytest
import torch
from helpers.checkpoints import write_tiny_checkpoint
from helpers.server import HANG_S, served

from specroll.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _api(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=HANG_S)


async def test_completions_text_and_token_prompts_seed_n_and_token_ids_round_trip(tiny_llama, tmp_path):
    async with served(tiny_llama, tmp_path) as s:
        api, model = _api(s.url), s.state.model_name
        extra = {"return_token_ids": True, "ignore_eos": True}
        first = await api.completions.create(model=model, prompt=PROMPT, max_tokens=12, seed=7, n=3,
                                             extra_body=extra)
        again = await api.completions.create(model=model, prompt=PROMPT, max_tokens=12, seed=7, n=3,
                                             extra_body=extra)
        other = await api.completions.create(model=model, prompt=PROMPT, max_tokens=12, seed=8, n=3,
                                             extra_body=extra)
        ids = [c.model_extra["token_ids"] for c in first.choices]
        assert len(first.choices) == 3 and all(len(t) == 12 for t in ids)
        assert ids == [c.model_extra["token_ids"] for c in again.choices]  # the seed reproduces
        assert ids != [c.model_extra["token_ids"] for c in other.choices]
        assert len({tuple(t) for t in ids}) > 1  # the n samples are not copies
        assert first.model_extra["prompt_token_ids"] == PROMPT
        assert [c.finish_reason for c in first.choices] == ["length"] * 3
        assert first.usage.prompt_tokens == len(PROMPT) and first.usage.completion_tokens == 36
        async with httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S) as http:
            for choice, token_ids in zip(first.choices, ids, strict=True):
                assert choice.model_extra["token_versions"] == [0] * 12
                text = (await http.post("/detokenize", json={"tokens": token_ids, "skip_special_tokens": True})).json()
                assert text["prompt"] == choice.text  # ids -> detokenize -> the text returned
            # A text prompt is the tokenizer's encoding of it.
            words = "Natalia sold clips"
            tokenized = (await http.post("/tokenize", json={"prompt": words})).json()
        by_text = await api.completions.create(model=model, prompt=words, max_tokens=4, seed=1, extra_body=extra)
        by_ids = await api.completions.create(model=model, prompt=tokenized["tokens"], max_tokens=4, seed=1,
                                              extra_body=extra)
        assert by_text.model_extra["prompt_token_ids"] == tokenized["tokens"]
        assert by_text.choices[0].model_extra["token_ids"] == by_ids.choices[0].model_extra["token_ids"]
        await api.close()


async def test_logprobs_and_tokens_equal_a_rollout_of_the_same_seed_streamed_or_not(tiny_llama, tmp_path):
    async with served(tiny_llama, tmp_path) as s:
        api, model = _api(s.url), s.state.model_name
        sampling = SamplingParams(temperature=0.8, top_k=50, max_tokens=16, seed=11, ignore_eos=True)
        group_id = await s.client.submit(PROMPT, 2, sampling, lane="eval")
        await s.client.wait_finished(1, timeout=HANG_S, lane="eval")
        (group,) = s.client.pop_finished(lane="eval")
        assert group.group_id == group_id
        reply = await api.completions.create(
            model=model, prompt=PROMPT, max_tokens=16, seed=11, n=2, temperature=0.8, logprobs=1,
            extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True,
                        "return_tokens_as_token_ids": True})
        for sample, choice in zip(group.samples, reply.choices, strict=True):
            assert choice.model_extra["token_ids"] == sample.token_ids
            assert choice.logprobs.token_logprobs == pytest.approx(sample.logprobs, abs=1e-6)
            assert choice.logprobs.tokens == [f"token_id:{t}" for t in sample.token_ids]
        chat = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Natalia sold clips"}], max_tokens=10, seed=3,
            logprobs=True, extra_body={"return_token_ids": True, "ignore_eos": True})
        prompt_ids = chat.model_extra["prompt_token_ids"]
        group_id = await s.client.submit(prompt_ids, 1, SamplingParams(max_tokens=10, seed=3, ignore_eos=True),
                                         lane="eval")
        await s.client.wait_finished(1, timeout=HANG_S, lane="eval")
        (group,) = s.client.pop_finished(lane="eval")
        (choice,) = chat.choices
        assert choice.model_extra["token_ids"] == group.samples[0].token_ids
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(group.samples[0].logprobs, abs=1e-6)
        # Streamed, the same request gives the same tokens, text and versions, in pieces.
        stream = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Natalia sold clips"}], max_tokens=10, seed=3,
            stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True,
                                                                              "ignore_eos": True})
        text, ids, versions, finish, usage = "", [], [], None, None
        async for event in stream:
            if event.usage is not None:
                usage = event.usage
            for c in event.choices:
                text += c.delta.content or ""
                ids += (c.model_extra or {}).get("token_ids") or []
                versions += (c.model_extra or {}).get("token_versions") or []
                finish = c.finish_reason or finish
        assert ids == choice.model_extra["token_ids"] and text == choice.message.content
        assert versions == [0] * 10 and finish == "length" and usage.completion_tokens == 10
        await api.close()


def test_the_sync_client_streams_completions_and_chats(tiny_llama, tmp_path):
    async def main() -> None:
        async with served(tiny_llama, tmp_path) as s:
            def calls() -> None:
                with openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=HANG_S) as api:
                    whole = api.completions.create(model=s.state.model_name, prompt="Natalia", max_tokens=8,
                                                   seed=5, extra_body={"ignore_eos": True})
                    pieces = api.completions.create(model=s.state.model_name, prompt="Natalia", max_tokens=8,
                                                    seed=5, stream=True, extra_body={"ignore_eos": True})
                    assert "".join(e.choices[0].text for e in pieces if e.choices) == whole.choices[0].text
                    models = api.models.list()
                    assert [m.id for m in models.data] == [s.state.model_name]
                    assert models.data[0].model_extra["max_model_len"] == 512
                    chat = api.chat.completions.create(model=s.state.model_name, max_tokens=4,
                                                       messages=[{"role": "user", "content": "hi"}])
                    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason

            await anyio.to_thread.run_sync(calls)

    anyio.run(main)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _teach(model: torch.nn.Module, prompt: list[int], answer: list[int], steps: int = 300) -> None:
    """Teacher-force ``answer`` after ``prompt`` until the model says it greedily."""
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    model.eval()


async def test_a_tool_call_from_a_model_taught_it_and_published_over_http(tmp_path):
    model_dir = tmp_path / "taught"
    model_dir.mkdir()
    policy = write_tiny_checkpoint(model_dir, max_position_embeddings=1024)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    async with served(model_dir, tmp_path) as s:
        api, name = _api(s.url), s.state.model_name
        async with httpx.AsyncClient(base_url=s.url.removesuffix("/v1"), timeout=HANG_S) as http:
            prompt = (await http.post("/tokenize", json={"messages": messages, "tools": TOOLS})).json()["tokens"]
            answer = (await http.post("/tokenize", json={"prompt": CALL, "add_special_tokens": False})).json()
            _teach(policy, prompt, answer["tokens"] + [2])  # then <|im_end|>: the end of the turn
            policy.save_pretrained(s.weights_dir / "v1")  # safetensors, the tied head written once
            update = await http.post("/update_weights", json={"path": "v1"})
            assert update.status_code == 200 and update.json() == {"policy_version": 1}
        reply = await api.chat.completions.create(model=name, messages=messages, tools=TOOLS, temperature=0,
                                                  max_tokens=120)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert call.id.startswith("call_") and set(choice.model_extra["token_versions"]) == {1}
        # tool_choice none: the same words are content.
        plain = await api.chat.completions.create(model=name, messages=messages, tools=TOOLS, tool_choice="none",
                                                  temperature=0, max_tokens=120)
        assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
        assert plain.choices[0].finish_reason == "stop"
        # Streamed: the call arrives as one tool-call delta, the finish reason is tool_calls.
        stream = await api.chat.completions.create(model=name, messages=messages, tools=TOOLS, temperature=0,
                                                   max_tokens=120, stream=True)
        deltas, finish, content = [], None, ""
        async for event in stream:
            for c in event.choices:
                deltas += c.delta.tool_calls or []
                content += c.delta.content or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and content == ""
        assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
        assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
        # A chat without tools, with a stop string: the text ends before it.
        stopped = await api.chat.completions.create(model=name, messages=messages, tools=TOOLS, temperature=0,
                                                    tool_choice="none", max_tokens=120, stop=["get_weather"])
        assert stopped.choices[0].message.content == CALL[: CALL.index("get_weather")]
        assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == \
            "get_weather"
        await api.close()
