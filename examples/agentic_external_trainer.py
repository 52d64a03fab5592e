"""A foreign training loop (its own model, loss, optimizer) for multi-turn, tool-using episodes, driven
through specroll's OpenAI-compatible server with the real `openai` client and trained on the token ids,
logprobs and policy versions the server returned. It starts `specroll serve` (the server and one
generator) itself:  python examples/agentic_external_trainer.py [--model smollm2-135m] [--steps 2]
"""

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import torch
from safetensors.torch import save_file

from specroll.engine import CausalLM, load_checkpoint
from specroll.envs.calculator import TOOL, calculate, messages_for
from specroll.rl.tasks import builtin_task, gsm8k_reward

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--max-tokens", type=int, default=48)  # per reply: a tool call takes ~25 tokens
parser.add_argument("--group-size", type=int, default=4)
args = parser.parse_args()
MAX_TURNS, PROMPTS_PER_STEP = 3, 2


def wait_until_serving(server: subprocess.Popen, run_dir: Path, timeout_s: float = 600) -> str:
    """The server's base URL, once GET /health answers 200 (a generator is connected)."""
    deadline = time.monotonic() + timeout_s
    while server.poll() is None and time.monotonic() < deadline:
        try:
            url = (run_dir / "server.url").read_text().strip()
            urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5)
            return url
        except (OSError, ValueError):  # no URL yet (or half written), or 503: no generator yet
            time.sleep(0.5)
    raise RuntimeError(f"specroll serve not serving (exit code {server.poll()}); its log is above")


async def episode(api: openai.AsyncOpenAI, model: str, question: str, answer: str, session: str):
    """One calculator episode: each model turn as the server returned it, the reward, the tool calls."""
    api = api.with_options(default_headers={"X-Session-ID": session})  # turn k+1 = turn k's tokens + new ones
    messages, turns, calls = messages_for(question), [], 0
    for _ in range(MAX_TURNS):
        reply = await api.chat.completions.create(
            model=model, messages=messages, tools=[TOOL], max_tokens=args.max_tokens, temperature=1.0,
            logprobs=True, extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        turns.append((reply.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                      [t.logprob for t in choice.logprobs.content], choice.model_extra["token_versions"]))
        message = choice.message  # sent back as returned, so the server can continue the session's tokens
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls or []] or None})
        if not message.tool_calls:
            break  # an answer (a model that writes no tool call ends its episode after one turn)
        for call in message.tool_calls:
            calls += 1
            expression = str(json.loads(call.function.arguments).get("expression", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return turns, gsm8k_reward(message.content or "", answer), calls


def sequences(turns: list) -> list[tuple[list[int], list[bool], list[float]]]:
    """An episode's trained sequences: (token ids, trained mask, behavior logprobs). A turn whose prompt
    starts with the sequence so far (the last prompt + completion) continues it, the tokens in between
    being the environment's (tool results, template): in the sequence, out of the loss. Any other turn
    (a template that rewrote the history) starts a new sequence."""
    seqs = []
    for prompt, ids, logprobs, _ in turns:
        if seqs and prompt[: len(seqs[-1][0])] == seqs[-1][0]:
            env = prompt[len(seqs[-1][0]) :]
        else:
            env = prompt
            seqs.append(([], [], []))
        seqs[-1][0].extend(env + ids)
        seqs[-1][1].extend([False] * len(env) + [True] * len(ids))
        seqs[-1][2].extend([0.0] * len(env) + logprobs)
    return seqs


async def train(url: str, weights_dir: Path) -> None:
    ckpt = load_checkpoint(args.model)  # the trainer's own copy of the policy
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    prompts = builtin_task(PROMPTS_PER_STEP * args.steps, digits=2, operators="*").train  # "What is 37 * 48?"
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=600) as api:
        name = (await api.models.list()).data[0].id
        for step in range(1, args.steps + 1):
            batch = prompts[PROMPTS_PER_STEP * (step - 1) : PROMPTS_PER_STEP * step]
            episodes = await asyncio.gather(*(episode(api, name, p.question, p.answer, f"s{step}-{p.prompt_id}-{i}")
                                              for p in batch for i in range(args.group_size)))
            rewards = torch.tensor([reward for _, reward, _ in episodes]).view(len(batch), args.group_size)
            advantages = (rewards - rewards.mean(1, keepdim=True)).flatten()  # REINFORCE, group-mean baseline
            trained_seqs = [sequences(turns) for turns, _, _ in episodes]
            optimizer.zero_grad()
            for seqs, advantage in zip(trained_seqs, advantages, strict=True):
                for ids, trained, behavior in seqs:
                    x = torch.tensor([ids])
                    logp = model.score(x, x >= 0)[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
                    ratio = (logp - torch.tensor(behavior[1:])).exp().clamp(max=2.0).detach()  # truncated IS
                    loss = -(advantage * ratio * logp)[torch.tensor(trained[1:])].sum() / len(episodes)
                    loss.backward()  # one sequence at a time: gradients accumulate
            optimizer.step()
            versions = sorted({v for turns, _, _ in episodes for turn in turns for v in turn[3]})
            print(f"step {step}: mean reward {rewards.mean():.2f}, tool calls {sum(c for _, _, c in episodes)}, "
                  f"{sum(len(t) for t, _, _ in episodes)} turns in {sum(map(len, trained_seqs))} sequences of "
                  f"{len(episodes)} episodes, tokens from policy versions {versions}", flush=True)
            if versions != [step - 1]:  # the update below is served before the next step's first request
                raise RuntimeError(f"step {step}'s tokens came from versions {versions}; expected [{step - 1}]")
            folder = weights_dir / f"step-{step}"  # the next policy version, as HTTP sees it
            folder.mkdir(parents=True)
            save_file({k: v.contiguous().clone() for k, v in model.hf_weights().items()}, folder / "model.safetensors")
            body = json.dumps({"path": folder.name, "version": step}).encode()  # relative to server.weights_dir
            update = urllib.request.Request(url.removesuffix("/v1") + "/update_weights", body,
                                            {"Content-Type": "application/json"})
            urllib.request.urlopen(update, timeout=600).close()  # answers once every generator serves the version


with tempfile.TemporaryDirectory() as tmp:  # the server and one generator, with the agentic example's settings
    server = subprocess.Popen([sys.executable, "-m", "specroll.actors.cli", "serve", "--config",
                               str(Path(__file__).with_name("agentic_smollm2.toml")), "--set", f"run_dir={tmp}",
                               "--set", f"model.name={args.model}", "--set", "server.port=0",
                               "--set", "generator.count=1"], stdout=sys.stderr, start_new_session=True)
    try:
        asyncio.run(train(wait_until_serving(server, Path(tmp)), Path(tmp) / "weights"))  # server.weights_dir
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops the generator and the server
        server.wait()
