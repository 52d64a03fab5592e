"""The training–inference logprob mismatch of a GRPO step (``grpo_step.Mismatch``): the trainer's own
logprob of every lag-0 token against the behavior logprob the engine recorded when it sampled it.

Rollouts come from a real engine on a tiny fp32 checkpoint; the trainer is a ``CausalLM`` with the
same weights. Against the same weights the gap is float noise; against deliberately perturbed engine
weights it is clearly not; tokens of an older version (sampled by other weights) never count.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import Group, Sample
from specroll.rl.grpo_step import build_batch, train_step

SETTINGS = dict(max_staleness=1, staleness_policy="mask", grad_accum_steps=2, loss="tis", tis_cap=2.0, clip_eps=0.2,
                max_grad_norm=1.0, precision="fp32", head_chunk=0)


class _Settings:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def _rollouts(model: Path, weights: dict[str, torch.Tensor], version: int, seed: int) -> list[Group]:
    """Two groups of 3 samples sampled at T = 1 by an engine serving ``weights`` as ``version``."""
    engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory_gb=0.02, seed=seed))
    engine.update_weights(weights, version)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    for g, prompt in enumerate(prompts):
        for i in range(3):
            engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=seed * 100 + g * 10 + i),
                               request_id=f"{g}-{i}")
    done = run_to_completion(engine)
    groups = []
    for g, prompt in enumerate(prompts):
        samples = [Sample(list(c.token_ids), list(c.logprobs), list(c.versions), c.finish_reason)
                   for c in (done[f"{g}-{i}"] for i in range(3))]
        groups.append(Group(f"v{version}-g{g}", prompt, samples, SamplingParams()))
    return groups


def _step(model: Path, groups: list[Group], version: int):
    ckpt = load_checkpoint(model)
    policy = CausalLM(ckpt.config)
    policy.load_weights(ckpt.weights)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    rewards = torch.tensor([[1.0, 0.0, 0.0]] * len(groups))
    batch = build_batch(groups, rewards, normalize_std=True, fill_version=version)
    return train_step(policy, optimizer, batch, version, _Settings(**SETTINGS))


def _perturbed(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: v + scale * torch.randn(v.shape, generator=gen) * v.abs().mean() for k, v in weights.items()}


def test_same_weights_in_fp32_agree_and_older_tokens_do_not_count(tiny_checkpoint) -> None:
    model = tiny_checkpoint("llama")
    weights = load_checkpoint(model).weights
    fresh = _rollouts(model, weights, version=3, seed=1)  # sampled by the weights trained now
    stale = _rollouts(model, _perturbed(weights, 0.5), version=2, seed=2)  # by other (older) weights
    result = _step(model, fresh + stale, version=3)
    m = result.mismatch
    lag0 = sum(len(s.token_ids) for g in fresh for s in g.samples)
    assert m.tokens == lag0 > 0  # exactly the lag-0 tokens: the stale ones are left out
    assert result.staleness == {0: lag0, 1: sum(len(s.token_ids) for g in stale for s in g.samples)}
    assert m.diff_max is not None and m.diff_max <= 1e-5, m
    assert m.diff_mean is not None and m.diff_mean <= 1e-6, m
    assert m.kl_k3 is not None and abs(m.kl_k3) <= 1e-9, m


def test_perturbed_generator_weights_show_a_clear_gap(tiny_checkpoint) -> None:
    model = tiny_checkpoint("llama")
    weights = load_checkpoint(model).weights
    groups = _rollouts(model, _perturbed(weights, 0.5), version=3, seed=1)  # the "generator" drifted
    m = _step(model, groups, version=3).mismatch
    assert m.tokens > 0
    assert m.diff_mean is not None and m.diff_mean > 1e-2, m
    assert m.diff_max is not None and m.diff_max > m.diff_mean
    assert m.kl_k3 is not None and m.kl_k3 > 1e-4, m


def test_no_lag0_token_gives_no_figure(tiny_checkpoint) -> None:
    model = tiny_checkpoint("llama")
    groups = _rollouts(model, load_checkpoint(model).weights, version=2, seed=1)
    m = _step(model, groups, version=3).mismatch
    assert (m.tokens, m.diff_mean, m.diff_max, m.kl_k3) == (0, None, None, None)
