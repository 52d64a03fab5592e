"""Speculative decoding inside the engine: lossless for greedy, exact logprobs, K/V rolled back."""

from __future__ import annotations

import pytest
import torch
from conftest import teacher_forced_logits

from specroll.drafter.suffix import SuffixProposer
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.sampler import processed_logprobs
from specroll.protocol.sampling import SamplingParams

PAGE, K = 8, 4


def make_engine(path, speculative: bool, **kw) -> Engine:
    settings: dict = dict(model=str(path), page_size=PAGE, kv_cache_memory_gb=0.01, max_model_len=256,
                          dtype="float32", num_draft_tokens=K)
    config = EngineConfig(**{**settings, **kw})
    return Engine(config, proposer=SuffixProposer(min_ngram=1, max_ngram=4) if speculative else None)


def repetitive_prompts(lengths: list[int]) -> list[list[int]]:
    """Prompts made of repeated motifs, so suffix matching drafts often (accepted or not)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        motif = torch.randint(3, 300, (5,), generator=g).tolist()
        out.append((motif * (n // 5 + 1))[:n])
    return out


def run(engine: Engine, prompts: list[list[int]], sampling: SamplingParams, groups: bool = False):
    for i, p in enumerate(prompts):
        engine.add_request(p, sampling, f"r{i}", group_id=f"g{i // 2}" if groups else None)
    return run_to_completion(engine)


@pytest.mark.parametrize("groups", [False, True])
def test_greedy_speculative_equals_greedy_plain_across_page_boundaries(tiny_checkpoint, groups):
    path = tiny_checkpoint("llama")
    lengths = [PAGE * m - j for m in (2, 3) for j in range(K + 1)]  # page_size·m − j, j = 0..k
    prompts = repetitive_prompts(lengths)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = run(make_engine(path, False), prompts, greedy, groups)
    spec_engine = make_engine(path, True)
    spec = run(spec_engine, prompts, greedy, groups)
    assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids for r, c in plain.items()}
    for r, c in spec.items():
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 20
        assert c.logprobs == pytest.approx(plain[r].logprobs, abs=1e-4)
    assert spec_engine.num_drafted > 0 and 0 < spec_engine.num_accepted < spec_engine.num_drafted
    assert spec_engine.block_manager.num_free_pages == spec_engine.block_manager.num_pages


def test_sampled_speculative_logprobs_equal_teacher_forcing(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts([13, 21, 30])
    sampling = SamplingParams(temperature=0.8, top_k=30, top_p=0.95, max_tokens=24, seed=3, ignore_eos=True)
    engine = make_engine(path, True)
    done = run(engine, prompts, sampling)
    assert engine.num_drafted > 0
    reference = make_engine(path, False)
    for i, p in enumerate(prompts):
        c = done[f"r{i}"]
        logits = teacher_forced_logits(reference, p, c.token_ids)
        expected = processed_logprobs(logits, [sampling] * len(c.token_ids))
        expected = expected.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.isfinite(expected).all()
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 1e-4


def test_rejected_drafts_release_their_pages_and_the_context_is_never_passed(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompt = repetitive_prompts([27])[0]
    engine = make_engine(path, True, max_model_len=len(prompt) + 9)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), "r")
    bm = engine.block_manager
    while engine.has_unfinished():
        outputs = engine.step()
        for seq in engine.scheduler.running:  # after rollback, pages hold exactly the valid K/V
            assert len(seq.block_table) == bm.pages_needed(seq.num_computed_tokens)
    (out,) = outputs
    assert out.finish_reason == "length" and out.num_output_tokens == 9
    assert engine.num_drafted > engine.num_accepted > 0
