"""Graph steps (``engine/step_graphs.py``): buckets, padding and static inputs, checked on the CPU
with ``cuda_graphs = "emulate"`` (the graph path without capturing) against eager steps."""

from __future__ import annotations

import functools
import re

import pytest
from helpers import engines
from helpers.engines import PAGE, K, k_drafts, repetitive_prompts, run

from specroll.engine.config import EngineConfig
from specroll.engine.step_graphs import bucket_sizes, pad_uniform_step, pick_bucket
from specroll.protocol.sampling import SamplingParams

make_engine = functools.partial(engines.make_engine, num_draft_tokens=K, max_num_seqs=8)  # each call sets cuda_graphs



def test_bucket_sizes_default_to_powers_then_multiples_of_16() -> None:
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_sizes(3) == (1, 2, 3)
    assert bucket_sizes(8, [6, 2, 12, 2]) == (2, 6)
    assert pick_bucket(5, (1, 2, 4, 8)) == 8 and pick_bucket(4, (1, 2, 4, 8)) == 4
    assert pick_bucket(9, (1, 2, 4, 8)) is None
    with pytest.raises(ValueError, match=r"cuda_graph_batch_sizes \[4, 0\]: expected positive integers, got \[0\]"):
        bucket_sizes(8, [4, 0])


def test_padding_appends_scratch_sequences_after_the_real_ones() -> None:
    padded = pad_uniform_step([5, 6, 7, 8], 2, [9, 4], [[3, 1], [7]], bucket=4, scratch_pages=[30])
    assert padded.input_ids == [5, 6, 7, 8, 0, 0, 0, 0]
    assert padded.q_lens == [2, 2, 2, 2] and padded.kv_lens == [9, 4, 2, 2]
    assert padded.block_tables == [[3, 1], [7], [30], [30]] and padded.num_real == 2
    with pytest.raises(ValueError, match="3 sequences do not fit a bucket of 2"):
        pad_uniform_step([1, 2, 3], 1, [4, 4, 4], [[0], [1], [2]], bucket=2, scratch_pages=[9])
    with pytest.raises(ValueError, match="3 token ids and 2 block tables for 2 sequences of 2 new tokens"):
        pad_uniform_step([1, 2, 3], 2, [4, 4], [[0], [1]], bucket=2, scratch_pages=[9])


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_steps_emit_exactly_what_eager_steps_emit(tiny_checkpoint, speculative: bool, temperature: float):
    # Seeded sampling draws from each request's own generator, so the tokens match only if every
    # real row's logits reach its own request: padding rows and bucket changes must not move them.
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(7)
    eager = run(make_engine(path, k_drafts(speculative), cuda_graphs="off"), prompts, temperature)
    engine = make_engine(path, k_drafts(speculative), cuda_graphs="emulate")
    graphed = run(engine, prompts, temperature)
    assert {r: t for r, (t, _) in graphed.items()} == {r: t for r, (t, _) in eager.items()}
    for r, (_, logprobs) in graphed.items():
        assert logprobs == pytest.approx(eager[r][1], abs=1e-5)
    graphs = engine.runner.graphs
    buckets = {bucket for bucket, _ in graphs.captured()}
    assert graphs.num_replays > 0
    if speculative:  # verify steps with K drafts each replay the K + 1 graphs, as the batch shrinks
        assert any(q_len == K + 1 for _, q_len in graphs.captured()) and len(buckets) >= 2, graphs.captured()
        assert engine.spec_stats.num_accepted > 0 or temperature > 0  # greedy accepts repeated motifs
    else:
        assert buckets == {8, 4, 2, 1}, graphs.captured()  # 7 live sequences shrinking to 1
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_padding_writes_only_to_scratch_pages_no_request_is_given(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"), cuda_graphs="emulate")
    runner = engine.runner
    total = runner.kv_caches[0].shape[0]
    assert runner.scratch_pages == list(range(total - 1, total)) and engine.block_manager.num_pages == total - 1
    for i, prompt in enumerate(repetitive_prompts(3)):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), f"r{i}")
    while any(not engine.output_so_far(r)[0] for r in engine.live_request_ids()):
        engine.step()  # prefills (eager: not uniform)
    before = [cache.clone() for cache in runner.kv_caches]
    replays = runner.graphs.num_replays
    engine.step()  # 3 decodes padded to the bucket of 4
    assert runner.graphs.num_replays == replays + 1
    owned = {p for seq in engine.scheduler.running for p in seq.block_table}  # a page the step took included
    changed = {p for old, new in zip(before, runner.kv_caches, strict=True)
               for p in (old != new).flatten(1).any(1).nonzero().flatten().tolist()}
    assert changed - owned == set(runner.scratch_pages)  # the padding sequence wrote there, and only there


def test_steps_outside_the_buckets_run_eagerly(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(4)
    eager = run(make_engine(path, cuda_graphs="off", max_num_seqs=4), prompts, 0.0)
    engine = make_engine(path, cuda_graphs="emulate", max_num_seqs=4, cuda_graph_batch_sizes=(2,))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True), f"r{i}")
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        live = engine.num_live_requests
        replays = engine.runner.graphs.num_replays
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if live > 2:  # a batch above the largest bucket (and every prefill) runs eagerly
            assert engine.runner.graphs.num_replays == replays
    assert engine.runner.graphs.captured() == [(2, 1)]  # 2 live decodes, then 1 padded to 2
    assert out == {r: t for r, (t, _) in eager.items()}


def test_cuda_graphs_need_cuda_and_a_known_mode(tiny_checkpoint):
    with pytest.raises(ValueError, match="cuda_graphs='on' needs device 'cuda' and the flashinfer backend; got "
                                         "device 'cpu'"):
        EngineConfig(cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs='yes', expected one of 'off', 'on', 'emulate'"):
        EngineConfig(cuda_graphs="yes")
    for sizes, bad in (((0,), "[0]"), ((2.5, 4), "[2.5]"), (("4",), "['4']"), ((True, 4), "[True]")):
        with pytest.raises(ValueError, match=rf"expected positive integers, got {re.escape(bad)}"):
            EngineConfig(cuda_graph_batch_sizes=sizes)
    with pytest.raises(ValueError, match=r"cuda_graph_batch_sizes=\[2, 128\]: expected sizes at most max_num_seqs = 8"):
        EngineConfig(cuda_graph_batch_sizes=(2, 128), max_num_seqs=8)


def test_scratch_pages_count_against_the_cache_before_any_request(tiny_checkpoint):
    # Exactly the pages one full-length request needs: without graphs it serves; with them one page
    # is scratch, so the engine refuses to start rather than hang on a request it can never fit.
    path = tiny_checkpoint("llama")
    pages = 256 // PAGE
    page_bytes = 2 * 2 * PAGE * 2 * 16 * 4  # K and V, 2 layers, 2 K/V heads of 16, float32
    eager = make_engine(path, cuda_graphs="off", kv_cache_memory_gb=pages * page_bytes / 2**30)
    assert eager.block_manager.num_pages == pages
    with pytest.raises(ValueError, match=r"holds 32 pages of 8 tokens \(1 of them kept as the CUDA-graph "
                                         r"padding's scratch\), fewer than one 256-token request needs"):
        make_engine(path, cuda_graphs="emulate", kv_cache_memory_gb=pages * page_bytes / 2**30)
