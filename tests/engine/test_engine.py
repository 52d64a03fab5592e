"""Engine behaviour on tiny random-weight models: batching, prefix sharing, preemption, sampling."""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import teacher_forced_logits
from helpers.engines import make_engine

from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.protocol.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PAGE = 8


def prompts(n: int, lengths: list[int] | None = None, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [int(x) for x in torch.randint(3, 40, (n,), generator=g)]
    return [torch.randint(3, 300, (n_,), generator=g).tolist() for n_ in lengths]


def generate(engine: Engine, batch: list[list[int]], sampling=GREEDY, groups=None) -> list[list[int]]:
    for i, p in enumerate(batch):
        engine.add_request(p, sampling, f"r{i}", None if groups is None else groups[i])
    done = run_to_completion(engine)
    return [done[f"r{i}"].token_ids for i in range(len(batch))]


def one_at_a_time(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    return [generate(engine, [p])[0] for p in batch]


# Prompt lengths around page boundaries: page_size*m - j for j = 0..3.
BOUNDARY = [PAGE * m - j for m in (1, 2, 3) for j in range(4)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_equals_one_at_a_time(tiny_checkpoint, arch):
    engine = make_engine(tiny_checkpoint(arch))
    batch = prompts(len(BOUNDARY), BOUNDARY)
    assert generate(engine, batch) == one_at_a_time(engine, batch)


def test_chunked_prefill_and_small_budget_leave_greedy_unchanged(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    batch = prompts(6, [5, 33, 17, 40, 8, 24])
    reference = generate(make_engine(path), batch)
    assert generate(make_engine(path, max_num_batched_tokens=7, max_num_seqs=3), batch) == reference


def test_prefix_sharing_prefills_a_group_once_and_keeps_greedy(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompt = prompts(1, [PAGE * 4 + 3])[0]
    batch, groups = [prompt] * 4, ["g"] * 4
    shared = make_engine(path, enable_prefix_caching=True)
    computed = []
    original_prepare = shared.runner.prepare

    def counting_prepare(scheduled, drafts, *rest):
        computed.append(sum(s.num_new_tokens for s in scheduled))
        return original_prepare(scheduled, drafts, *rest)

    shared.runner.prepare = counting_prepare
    out_shared = generate(shared, batch, groups=groups)
    out_plain = generate(make_engine(path, enable_prefix_caching=False), batch, groups=groups)
    assert out_shared == out_plain
    # The group's 4 full prompt pages are computed once; each sibling computes only the tail.
    prompt_tokens = len(prompt) + 3 * (len(prompt) - 4 * PAGE)
    decode_tokens = 4 * (GREEDY.max_tokens - 1)
    assert sum(computed) == prompt_tokens + decode_tokens


def test_preemption_leaves_greedy_unchanged(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    batch = prompts(8, [30, 25, 31, 20, 28, 33, 26, 22])
    reference = generate(make_engine(path), batch)
    # 4 KiB per page for the tiny model: 40 pages = 320 token slots for 8 sequences of up to 57.
    small = make_engine(path, kv_cache_memory_gb=40 * 4096 / 2**30, max_model_len=128)
    assert small.block_manager.num_pages == 40
    assert generate(small, batch) == reference
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_pages == small.block_manager.num_pages


def test_seeded_sampling_is_independent_of_the_batch(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = generate(make_engine(path), prompts(1), sampling)[0]
    crowd = prompts(5, seed=7)
    engine = make_engine(path)
    for i, p in enumerate(crowd):
        engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=16, seed=i), f"other{i}")
    engine.add_request(prompts(1)[0], sampling, "mine")
    done = run_to_completion(engine)
    assert done["mine"].token_ids == alone
    other = generate(make_engine(path), prompts(1), SamplingParams(temperature=1.0, max_tokens=16, seed=99))[0]
    assert other != alone


def test_stop_conditions(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    engine = make_engine(path)
    prompt = prompts(1)[0]
    free_run = generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    stop_at = free_run[5]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_at,)), "s")
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), "m")
    done = run_to_completion(engine)
    first = free_run.index(stop_at)
    assert done["s"].token_ids == free_run[: first + 1] and done["s"].finish_reason == "stop"
    assert done["m"].token_ids == free_run[:7] and done["m"].finish_reason == "length"
    # The context length caps a response whatever max_tokens says.
    short = make_engine(path, max_model_len=len(prompt) + 4)
    short.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), "c")
    c = run_to_completion(short)["c"]
    assert len(c.token_ids) == 4 and c.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    engine = make_engine(path)
    prompt = prompts(1)[0]
    free_run = generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    engine.eos_token_ids = frozenset({free_run[3]})
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20), "e")
    done = run_to_completion(engine)["e"]
    assert done.finish_reason == "stop" and done.token_ids == free_run[: free_run.index(free_run[3]) + 1]


def test_abort_returns_every_token_in_any_state(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"), max_num_seqs=1)
    a, b = prompts(2)
    engine.add_request(a, GREEDY, "running")
    engine.add_request(b, GREEDY, "waiting")
    streamed: list[int] = []
    for _ in range(5):
        streamed += [t for o in engine.step() if o.request_id == "running" for t in o.new_token_ids]
    running = engine.abort("running")
    waiting = engine.abort("waiting")
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert running.token_ids == streamed and len(streamed) == 5 and len(running.logprobs) == 5
    assert waiting.token_ids == [] and waiting.prompt_token_ids == b
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    with pytest.raises(KeyError, match="running"):
        engine.abort("running")


def test_bad_requests_are_refused(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"), max_model_len=64)
    with pytest.raises(ValueError, match="64"):
        engine.add_request(list(range(3, 67)), GREEDY, "long")
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], GREEDY, "empty")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 99999], GREEDY, "oov")
    engine.add_request([5, 6], GREEDY, "dup")
    with pytest.raises(ValueError, match="already live"):
        engine.add_request([5, 6], GREEDY, "dup")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_bfloat16_engine_tracks_float32(tiny_checkpoint):
    """The default CPU dtype (bf16 where the CPU has it) stays close to the float32 reference."""
    path = tiny_checkpoint("llama")
    batch = prompts(4, [9, 16, 23, 30])
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    bf16 = make_engine(path, dtype="bfloat16")
    assert bf16.kv_caches[0].dtype == torch.bfloat16
    for i, p in enumerate(batch):
        bf16.add_request(p, sampling, f"r{i}")
    done = run_to_completion(bf16)
    # Teacher-force the bf16 engine's tokens through the float32 engine's model.
    reference = make_engine(path)
    for i, p in enumerate(batch):
        c = done[f"r{i}"]
        logits = teacher_forced_logits(reference, p, c.token_ids)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        diff = (torch.tensor(c.logprobs) - expected).abs()
        # bf16 keeps 8 bits of mantissa: logprobs move by a few hundredths on this sharp model.
        assert diff.mean().item() < 0.05 and diff.max().item() < 0.25, diff
