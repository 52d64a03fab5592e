"""The default model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF) through specroll's loader, model and
paged attention against transformers' own GGUF conversion of the same file.
"""

from __future__ import annotations

import pytest
import torch
from helpers.gsm8k_lines import GSM8K_LINES
from transformers import LlamaForCausalLM

from specroll.engine.attention import allocate_kv_cache
from specroll.engine.batch import build_metadata
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import Checkpoint
from specroll.engine.model import CausalLM
from specroll.engine.torch_attention import TorchAttention
from specroll.protocol.sampling import SamplingParams
from specroll.rl.tasks import format_question

pytestmark = pytest.mark.slow

QUESTION = GSM8K_LINES[0]["question"]
TOL = 1e-3


@pytest.fixture(scope="module")
def checkpoint(smollm2: Checkpoint) -> Checkpoint:
    return smollm2


@pytest.fixture(scope="module")
def reference(smollm2_transformers: LlamaForCausalLM) -> LlamaForCausalLM:
    return smollm2_transformers  # the session's (tests/conftest.py): transformers' own conversion of the file


@pytest.fixture(scope="module")
def prompt(checkpoint: Checkpoint) -> list[int]:
    return checkpoint.tokenizer.encode_chat(format_question(QUESTION))


def test_prefill_and_decode_logits_match_transformers(checkpoint: Checkpoint, reference, prompt: list[int]) -> None:
    config = checkpoint.config
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device="cpu").eval()
    model.load_weights(checkpoint.weights)
    page_size, decode_steps = 16, 6
    num_pages = -(-(len(prompt) + decode_steps) // page_size)
    table = torch.randperm(num_pages + 3, generator=torch.Generator().manual_seed(0))[:num_pages].tolist()
    caches = allocate_kv_cache(config, num_pages + 3, page_size, torch.float32, "cpu")
    backend = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim)

    meta = build_metadata([len(prompt)], [len(prompt)], [table], page_size)
    backend.plan(meta)
    prefill = model.compute_logits(model(torch.tensor(prompt), meta.positions(), caches, backend)[0])  # [P, V]
    ids, got = list(prompt), [prefill]
    for _ in range(decode_steps):  # greedy continuation, one token a step
        ids.append(int(got[-1][-1].argmax()))
        meta = build_metadata([1], [len(ids)], [table], page_size)
        backend.plan(meta)
        got.append(model.compute_logits(model(torch.tensor(ids[-1:]), meta.positions(), caches, backend)[0]))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, :-1].float()  # [P + steps - 1, V]
    got_all = torch.cat(got)[: expected.shape[0]]
    diff = (got_all - expected).abs()
    prefill_diff = diff[: len(prompt)].max().item()
    assert prefill_diff <= TOL, f"prefill: max |logits - transformers| = {prefill_diff}"
    assert diff.max().item() <= TOL, f"decode: max |logits - transformers| = {diff.max().item()}"
    assert expected.abs().max().item() > 10  # real logits, not a degenerate model


def test_greedy_generation_equals_transformers(checkpoint: Checkpoint, reference, prompt: list[int]) -> None:
    engine = Engine(EngineConfig(model="smollm2-135m", kv_cache_memory_gb=0.05, max_model_len=1024,
                                 dtype="float32"), checkpoint)
    max_tokens = 32
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), "q")
    done = run_to_completion(engine)["q"]
    eos = 2  # <|im_end|>
    with torch.no_grad():
        generated = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                       eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    assert done.token_ids == generated
    text = checkpoint.tokenizer.decode(done.token_ids)
    # A coherent start of an answer about the question, in English.
    assert text.isascii() and len(text.split()) >= 10, text
    assert any(word in text for word in ("Natalia", "clips", "48", "April", "May")), text


@pytest.mark.parametrize("drafter", ["suffix", "eagle"])
def test_greedy_speculative_equals_greedy_plain_across_page_boundaries(checkpoint: Checkpoint, drafter: str) -> None:
    from specroll.drafter.eagle import EagleProposer
    from specroll.drafter.eagle_config import EagleConfig, build_draft_vocab, eagle3_feature_layers
    from specroll.drafter.eagle_head import EagleHead
    from specroll.drafter.suffix import SuffixProposer

    page, k = 16, 4
    questions = [QUESTION, "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts "
                 "in total does it take? Show your work step by step and repeat the numbers you use."]
    encoded = [checkpoint.tokenizer.encode_chat(format_question(q)) for q in questions]
    lengths = [page * m - j for m in (4, 5) for j in range(k + 1)]  # page_size·m − j, j = 0..k
    prompts = [encoded[i % 2][:n] for i, n in enumerate(lengths)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)

    def generate(proposer) -> dict[str, list[int]]:
        config = EngineConfig(model="smollm2-135m", kv_cache_memory_gb=0.05, max_model_len=1024, dtype="float32",
                              page_size=page, num_draft_tokens=k)
        engine = Engine(config, checkpoint, proposer=proposer)
        for i, p in enumerate(prompts):
            engine.add_request(p, greedy, f"r{i}", group_id=f"g{i % 2}")
        done = run_to_completion(engine)
        if proposer is not None:
            assert engine.spec_stats.num_drafted > 0
        return {r: c.token_ids for r, c in done.items()}

    if drafter == "suffix":
        proposer = SuffixProposer()
    else:
        config = checkpoint.config
        head_config = EagleConfig.for_target(config, eagle3_feature_layers(config.num_layers), 8192)
        counts = torch.arange(config.vocab_size, 0, -1).double()
        proposer = EagleProposer(EagleHead.init(head_config, build_draft_vocab(counts, 8192)), page_size=page)
    assert generate(proposer) == generate(None)


def test_the_stand_in_shapes_are_the_default_models(checkpoint: Checkpoint) -> None:
    """GPU checks run random weights at ``SMOLLM2_135M``'s shapes: they must be the real model's."""
    from specroll.engine.model_config import SMOLLM2_135M

    assert checkpoint.config == SMOLLM2_135M
