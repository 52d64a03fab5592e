"""The engine's prefix-cache counters (``BlockManager.prefix_counters``): prompt tokens admitted and
those whose K/V came from the cache, each request counted once, a preemption's re-admission not."""

from __future__ import annotations

import torch
from helpers.engines import PAGE, make_engine

from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.protocol.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def counters(engine: Engine) -> tuple[int, int]:
    c = engine.block_manager.prefix_counters
    return c.prompt_tokens, c.cached_prompt_tokens


def run(engine: Engine, prompt: list[int], request_id: str, group_id: str | None = None, n: int = 1) -> None:
    for i in range(n):
        engine.add_request(prompt, GREEDY, f"{request_id}#{i}", group_id)
    run_to_completion(engine)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_repeated_prompt_is_a_hit_and_after_forget_cached_it_is_not(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"))
    prompt = random_prompt(3 * PAGE + 5, seed=1)  # 3 full pages and a partial one
    assert counters(engine) == (0, 0)
    run(engine, prompt, "a")
    assert counters(engine) == (len(prompt), 0)
    run(engine, prompt, "b")
    assert counters(engine) == (2 * len(prompt), 3 * PAGE)  # its 3 full pages from the cache
    assert engine.block_manager.forget_cached() > 0
    run(engine, prompt, "c")
    assert counters(engine) == (3 * len(prompt), 3 * PAGE)  # computed again: no new hit
    run(engine, prompt, "d")
    assert counters(engine) == (4 * len(prompt), 6 * PAGE)  # keyed again by "c"


def test_a_prompt_of_whole_pages_always_computes_its_last_token(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"))
    prompt = random_prompt(2 * PAGE, seed=2)
    run(engine, prompt, "a")
    run(engine, prompt, "b")
    assert counters(engine) == (2 * len(prompt), PAGE)  # the last page holds the last token: computed


def test_a_groups_siblings_take_the_prompt_pages_one_member_computed(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"))
    prompt = random_prompt(2 * PAGE + 3, seed=3)
    run(engine, prompt, "g", group_id="g", n=4)
    assert counters(engine) == (4 * len(prompt), 3 * 2 * PAGE)


def test_no_hits_with_prefix_caching_off(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"), enable_prefix_caching=False)
    prompt = random_prompt(2 * PAGE + 3, seed=4)
    run(engine, prompt, "a")
    run(engine, prompt, "b")
    assert counters(engine) == (2 * len(prompt), 0)


def test_a_preempted_request_is_counted_once(tiny_checkpoint):
    # 40 pages of 8 tokens for 8 sequences of up to 57 tokens: some are preempted and re-admitted, and a
    # re-admission does not count the request's prompt again.
    engine = make_engine(tiny_checkpoint("llama"), kv_cache_memory_gb=40 * 4096 / 2**30, max_model_len=128)
    assert engine.block_manager.num_pages == 40
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate([30, 25, 31, 20, 28, 33, 26, 22])]
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, sampling, f"r{i}")
    run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert counters(engine) == (sum(map(len, prompts)), 0)
