"""The plain synchronous arm of ``bench_agentic.py``: what a user without specroll's trainer writes — a
loop over the ``openai`` client against an OpenAI-compatible server with TRL-style batching: start a
step's ``batch_groups × group_size`` episodes at once, wait for every one (the slowest tool call
included), train one step on them, push the new weights over HTTP (``POST /update_weights``), repeat.

The server is ``specroll serve`` with one generator (vLLM's role; the same engine as the other arms, so
only the loop differs); the episodes are the built-in calculator task's (``specroll.envs.calculator``,
the same code and tool latency as the launched arms), their turns read from the replies (``prompt_token_ids``,
``token_ids``, logprobs, ``token_versions``), and the step is specroll's own GRPO step
(``pack_episode_groups`` + ``train_step``, the same precision and settings), so the arms differ only
in how the work is scheduled. Writes ``OUT/steps.jsonl`` (one line per step, ``time``, ``episodes``,
``reward_mean``) and ``OUT/result.json`` (the held-out evaluations before and after training, the
generator's pid, ``serve``'s run directory).

    python benchmarks/agentic_loop.py --config RESOLVED.toml --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import torch
from safetensors.torch import save_file

from specroll.actors.config import RunConfig, load_config
from specroll.actors.trainer.episodes import episode_seed, sampling_kwargs
from specroll.actors.trainer.task_load import load_task
from specroll.engine import CausalLM, load_checkpoint
from specroll.envs.base import EpisodeOutcome, EpisodePrompt
from specroll.envs.calculator import CalculatorEnv, Latency
from specroll.rl.episodes import Episode, EpisodeGroup, Turn, pack_episode_groups
from specroll.rl.evaluation import eval_seed
from specroll.rl.grpo_step import policy_optimizer, train_step
from specroll.rl.tasks import Prompt


class _Recording:
    """``client.chat.completions.create`` that asks for token ids and logprobs and keeps each reply as a
    :class:`Turn` (what the server returned: the loop's only view of the tokens)."""

    def __init__(self, client: openai.AsyncOpenAI) -> None:
        self.client, self.turns = client, []
        self.chat = self
        self.completions = self

    async def create(self, **kwargs: Any) -> Any:
        extra = {**kwargs.pop("extra_body", {}), "return_token_ids": True}
        reply = await self.client.chat.completions.create(**kwargs, logprobs=True, extra_body=extra)
        choice = reply.choices[0]
        self.turns.append(Turn(reply.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                               [c.logprob for c in choice.logprobs.content], choice.model_extra["token_versions"],
                               choice.finish_reason, len(choice.message.tool_calls or [])))
        return reply


async def _episode(api: openai.AsyncOpenAI, env: CalculatorEnv, prompt: EpisodePrompt, session: str) -> Episode:
    client = _Recording(api.with_options(default_headers={"X-Session-ID": session}))
    start = time.monotonic()
    outcome = await env(client, prompt)  # type: ignore[arg-type]
    assert isinstance(outcome, EpisodeOutcome)
    return Episode(client.turns, outcome.reward, dict(outcome.metrics), time.monotonic() - start)


async def _evaluate(api: openai.AsyncOpenAI, env: CalculatorEnv, model: str, prompts: list[Prompt],
                    sampling: dict[str, Any]) -> float:
    """Held-out accuracy: one episode per prompt with its fixed evaluation seed (as the trainer's)."""
    episodes = await asyncio.gather(*(
        _episode(api, env, EpisodePrompt(p, model, {**sampling, "seed": eval_seed(i)}, eval_seed(i), True), f"e{i}")
        for i, p in enumerate(prompts)))
    return sum(e.reward >= 1.0 for e in episodes) / len(episodes)


def _publish(url: str, model: CausalLM, weights_dir: Path, version: int) -> None:
    folder = weights_dir / f"v{version}"
    folder.mkdir(parents=True)
    save_file({k: v.detach().contiguous().clone() for k, v in model.hf_weights().items()}, folder / "model.safetensors")
    body = json.dumps({"path": folder.name, "version": version}).encode()
    request = urllib.request.Request(url.removesuffix("/v1") + "/update_weights", body,
                                     {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=600).close()  # answers once the generator serves it


async def _train(config: RunConfig, url: str, serve_dir: Path, out: Path) -> None:
    tc, task = config.trainer, config.task
    torch.set_num_threads(tc.train_threads or 2)
    ckpt = load_checkpoint(config.model.name, torch.float32)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    optimizer = policy_optimizer(model.parameters(), tc.learning_rate, tc.weight_decay)
    split = load_task(config)
    env = CalculatorEnv(Latency(task.tool_latency_median_s, task.tool_latency_p99_s), task.max_turns)
    sampling = sampling_kwargs(config.generator.sampling)
    result: dict[str, Any] = {"serve_run_dir": str(serve_dir)}
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=900, max_retries=0) as api:
        name = (await api.models.list()).data[0].id
        result["eval_before"] = await _evaluate(api, env, name, split.eval, sampling)
        steps = open(out / "steps.jsonl", "w", encoding="utf-8")
        position = 0
        for step in range(1, config.steps + 1):
            start = time.time()
            prompts = [split.train[(position + g) % len(split.train)] for g in range(tc.batch_groups)]
            position += tc.batch_groups
            runs = [_episode(api, env, EpisodePrompt(p, name, {**sampling, "seed": s}, s), f"{step}-{g}-{i}")
                    for g, p in enumerate(prompts) for i in range(tc.group_size)
                    for s in [episode_seed(config.seed * 7919 + position + g, i, 0)]]
            episodes = await asyncio.gather(*runs)  # TRL-style: the whole batch, then train
            groups = [EpisodeGroup(f"{step}-{g}", p, list(episodes[g * tc.group_size:(g + 1) * tc.group_size]))
                      for g, p in enumerate(prompts)]
            generated = time.time()
            rewards, batch = pack_episode_groups(groups, normalize_std=tc.normalize_std, fill_version=step - 1)
            train_step(model, optimizer, batch, step - 1, tc)
            trained = time.time()
            _publish(url, model, serve_dir / "weights", step)
            steps.write(json.dumps({"step": step, "time": time.time(), "start": start, "generate_s": generated - start,
                                    "train_s": trained - generated, "publish_s": time.time() - trained,
                                    "episodes": len(episodes), "reward_mean": float(rewards.mean())}) + "\n")
            steps.flush()
        steps.close()
        result["eval_after"] = await _evaluate(api, env, name, split.eval, sampling)
    (out / "result.json").write_text(json.dumps(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved run config (the launched arms' own)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    config = load_config(args.config, [])
    args.out.mkdir(parents=True, exist_ok=True)
    serve_dir = args.out / "serve"
    server = subprocess.Popen([sys.executable, "-m", "specroll.actors.cli", "serve", "--config", args.config,
                               "--set", f'run_dir="{serve_dir}"', "--set", "server.port=0"],
                              stdout=sys.stderr, start_new_session=True)
    try:
        url = _wait_until_serving(server, serve_dir)
        asyncio.run(_train(config, url, serve_dir, args.out))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return 0


def _wait_until_serving(server: subprocess.Popen, run_dir: Path, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while server.poll() is None and time.monotonic() < deadline:
        try:
            url = (run_dir / "server.url").read_text().strip()
            urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5).close()
            return url
        except (OSError, ValueError):
            time.sleep(0.5)
    raise RuntimeError(f"specroll serve did not start serving (exit code {server.poll()})")


if __name__ == "__main__":
    sys.exit(main())
