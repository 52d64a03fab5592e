"""Behavior logprobs: what the engine reports for each token equals the teacher-forced log-probability
of that token under the processed distribution, computed independently with Hugging Face
transformers' model and its own logits warpers; and each token carries its policy version.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engines import make_engine
from msgspec.structs import replace
from transformers import AutoModelForCausalLM, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specroll.engine.driver import run_to_completion
from specroll.engine.loaders.checkpoint import expected_weight_shapes
from specroll.engine.sampler import processed_logprobs
from specroll.engine.sequence import Completion
from specroll.protocol.sampling import SamplingParams

TOL = 1e-4
MAX_TOKENS = 20


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (n,), generator=g).tolist()
    return [torch.randint(3, 300, (length,), generator=g).tolist() for length in lengths]


def oracle_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log_softmax of the processed distribution, with transformers' warpers in generate()'s order:
    temperature → top-k → top-p. Greedy: the raw logits' log_softmax (the engine's documented choice)."""
    scores = logits.double()  # [N, V]
    if not params.greedy:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
        if params.top_k > 0:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1.0:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)


def teacher_forced_logits(model: torch.nn.Module, c: Completion) -> torch.Tensor:
    """``[len(response), V]``: transformers' logits that predict each response token."""
    ids = torch.tensor(c.prompt_token_ids + c.token_ids)
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()  # [P + R, V]
    return logits[len(c.prompt_token_ids) - 1 : -1]


SAMPLINGS = {
    "t0.7-k20-p0.9": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True),
    "t1": SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "t1.3-p0.6": SamplingParams(temperature=1.3, top_p=0.6, max_tokens=MAX_TOKENS, ignore_eos=True),
    "t0.5-k3": SamplingParams(temperature=0.5, top_k=3, max_tokens=MAX_TOKENS, ignore_eos=True),
    # Greedy ignores top_k/top_p: its logprob is log_softmax of the raw logits at the argmax.
    "greedy": SamplingParams(temperature=0.0, top_k=5, top_p=0.5, max_tokens=MAX_TOKENS, ignore_eos=True),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_logprobs_equal_teacher_forced_processed_distribution(tiny_checkpoint, arch: str, name: str) -> None:
    path = tiny_checkpoint(arch, tie_word_embeddings=arch == "llama")
    params = SAMPLINGS[name]
    engine = make_engine(path)
    batch = prompts(4)
    for i, p in enumerate(batch):  # one batch, several seeds: each row its own distribution
        engine.add_request(p, params if params.greedy else replace(params, seed=i), f"r{i}")
    done = run_to_completion(engine)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i in range(len(batch)):
        c = done[f"r{i}"]
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == MAX_TOKENS
        logits = teacher_forced_logits(reference, c)
        expected_all = oracle_logprobs(logits, params)  # [R, V]
        tokens = torch.tensor(c.token_ids)
        expected = expected_all.gather(-1, tokens[:, None]).squeeze(-1)
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        # Every emitted token lies in the processed support.
        assert torch.isfinite(got).all(), f"{name}: engine logprobs {c.logprobs}"
        assert torch.isfinite(expected).all(), f"{name}: tokens outside transformers' support: {c.token_ids}"
        diff = (got - expected).abs().max().item()
        assert diff <= TOL, f"{name} r{i}: max |engine - transformers| logprob = {diff}"
        if params.greedy:
            assert c.token_ids == logits.argmax(-1).tolist()
        if params.top_k and not params.greedy:
            assert (torch.isfinite(expected_all).sum(-1) <= params.top_k).all()


@pytest.mark.parametrize("budget", [5, 16])
def test_logprobs_of_a_prompt_prefilled_in_chunks(tiny_checkpoint, budget: int) -> None:
    # One request whose prompt is longer than the step's token budget: the first steps compute
    # prompt chunks and sample nothing; the logprobs must still match the teacher-forced ones.
    path = tiny_checkpoint("llama")
    params = SAMPLINGS["t0.7-k20-p0.9"]
    engine = make_engine(path, max_num_batched_tokens=budget)
    prompt = torch.randint(3, 300, (3 * budget + 2,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.add_request(prompt, replace(params, seed=11), "long")
    c = run_to_completion(engine)["long"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = oracle_logprobs(teacher_forced_logits(reference, c), params)
    expected = expected.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
    assert len(c.token_ids) == MAX_TOKENS
    assert (torch.tensor(c.logprobs, dtype=torch.float64) - expected).abs().max().item() <= TOL


def test_filters_change_the_logprobs(tiny_checkpoint) -> None:
    # Guard for the test above: with these settings the processed distribution really differs from
    # the raw softmax, so a sampler that skipped a warper could not pass it.
    path = tiny_checkpoint("llama")
    engine = make_engine(path)
    engine.add_request(prompts(1)[0], SAMPLINGS["t0.7-k20-p0.9"], "r")
    c = run_to_completion(engine)["r"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    logits = teacher_forced_logits(reference, c)
    raw = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
    assert (torch.tensor(c.logprobs, dtype=torch.float64) - raw).abs().min().item() > 1e-2


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, 0, 1.0), (0.7, 20, 0.9), (1.5, 0, 0.3), (0.3, 7, 1.0), (1.0, 1, 1.0), (2.0, 50, 0.05), (0.0, 9, 0.2),
])
def test_processed_distribution_equals_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    # The whole processed distribution (support and values), not only the sampled tokens.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 320, generator=gen) * 3  # [B, V]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = processed_logprobs(logits, [params] * len(logits))
    expected = oracle_logprobs(logits, params)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    support = torch.isfinite(expected)
    assert ((got.double() - expected)[support]).abs().max().item() <= 1e-5
    if params.greedy:
        assert support.all()


def test_a_rows_distribution_does_not_depend_on_its_batch() -> None:
    # top_k=0 and top_p=1 disable both filters (SamplingParams' docs), whatever the other rows ask
    # for: a request's processed distribution, and so its seeded tokens, must not change with the
    # requests that happen to share its batch.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 320, generator=gen) * 3  # [B, V]
    unfiltered = SamplingParams(temperature=0.3)
    alone = processed_logprobs(logits[:1], [unfiltered])
    assert torch.isfinite(alone).all()
    batched = processed_logprobs(logits, [unfiltered, SamplingParams(temperature=0.3, top_k=5)])
    kept = int(torch.isfinite(batched[0]).sum())
    assert kept == logits.shape[1], f"an unfiltered row keeps {kept} of {logits.shape[1]} tokens next to a top-k row"
    assert torch.equal(batched[0], alone[0])


def test_versions_follow_weight_updates_mid_rollout(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint("llama"))
    assert engine.weight_version == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)
    a, b, late = prompts(3)
    engine.add_request(a, greedy, "a")
    engine.add_request(b, sampled, "b")
    streamed: dict[str, list[int]] = {"a": [], "b": [], "late": []}
    before = 4
    for _ in range(before):
        for out in engine.step():
            streamed[out.request_id] += out.new_versions
    assert streamed == {"a": [0] * before, "b": [0] * before, "late": []}
    # A partial rollout crosses the update: its earlier tokens keep version 0, later ones get 5.
    norms = {name: torch.full(shape, 1.5) for name, shape in expected_weight_shapes(engine.model_config).items()
             if name.endswith("norm.weight")}
    engine.update_weights(norms, version=5)
    assert engine.weight_version == 5
    engine.add_request(late, sampled, "late")
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.new_versions
            assert out.new_versions == [5]
    for rid in ("a", "b"):
        assert streamed[rid] == [0] * before + [5] * (MAX_TOKENS - before)
    assert streamed["late"] == [5] * MAX_TOKENS


def test_completion_versions_across_an_update(tiny_checkpoint) -> None:
    # Completion.versions (what abort and run_to_completion return) aligns with its tokens too.
    engine = make_engine(tiny_checkpoint("llama"))
    engine.add_request(prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), "a")
    for _ in range(3):
        engine.step()
    engine.update_weights({"model.norm.weight": torch.full((64,), 2.0)}, version=1)
    for _ in range(2):
        engine.step()
    c = engine.abort("a")
    assert c.versions == [0, 0, 0, 1, 1]
    assert len(c.token_ids) == len(c.logprobs) == 5
