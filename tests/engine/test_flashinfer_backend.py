"""The FlashInfer backend on a machine without CUDA: it imports, its plan arguments agree with the
torch backend's own metadata, and choosing it where it cannot run fails clearly."""

from __future__ import annotations

import importlib.util
import random
import sys

import msgspec
import pytest
import torch

from specroll.engine.attention import select_backend
from specroll.engine.batch import build_metadata
from specroll.engine.config import EngineConfig
from specroll.engine.engine import Engine
from specroll.engine.flashinfer_attention import FlashInferAttention, plan_arguments
from specroll.engine.model_config import ModelConfig
from specroll.engine.torch_attention import TorchAttention

PAGE = 16
CONFIG = ModelConfig(
    architecture="llama", vocab_size=320, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def ragged_batch(rng: random.Random, q_lens: list[int], kv_lens: list[int]):
    """Metadata for a batch whose sequences own shuffled, non-contiguous pages."""
    pages = list(range(200))
    rng.shuffle(pages)
    tables = []
    for kv_len in kv_lens:
        n = -(-kv_len // PAGE)
        tables.append([*pages[:n], 999])  # a spare trailing page the metadata must not list
        pages = pages[n:]
    return build_metadata(q_lens, kv_lens, tables, PAGE)


CASES = {
    "prefill across page boundaries": ([1, 15, 16, 17, 100, 300], [1, 15, 16, 17, 100, 300]),
    "decode at page boundaries": ([1] * 6, [1, 16, 17, 32, 33, 250]),
    "verify k=1..8": ([2, 3, 4, 5, 6, 7, 8, 9], [2, 18, 20, 33, 64, 70, 100, 129]),
    "mixed chunk, decode, verify": ([40, 1, 5, 1], [90, 17, 21, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_arguments_match_the_torch_backend(case: str) -> None:
    q_lens, kv_lens = CASES[case]
    meta = ragged_batch(random.Random(case), q_lens, kv_lens)
    args = plan_arguments(meta)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "batch_indices", "positions"):
        assert getattr(args, name).dtype == torch.int32, name  # FlashInfer indexes with int32 only
    assert args.decode_only == all(q == 1 for q in q_lens)
    # K/V length per sequence as FlashInfer derives it (get_seq_lens): the lengths we built.
    num_pages = (args.kv_indptr[1:] - args.kv_indptr[:-1]).long()
    assert ((num_pages - 1) * PAGE + args.kv_last_page_len.long()).tolist() == kv_lens
    assert bool((args.kv_last_page_len >= 1).all() and (args.kv_last_page_len <= PAGE).all())
    # Each appended row goes to the sequence and position the torch backend writes it to.
    expected_batch = [b for b, q in enumerate(q_lens) for _ in range(q)]
    assert args.batch_indices.tolist() == expected_batch
    assert args.positions.tolist() == [kv - q + j for q, kv in zip(q_lens, kv_lens, strict=True) for j in range(q)]
    reference = TorchAttention(CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim)
    reference.plan(meta)
    b, pos = args.batch_indices.long(), args.positions.long()
    page = args.kv_indices.long()[args.kv_indptr.long()[b] + pos // PAGE]
    assert (page * 2 * PAGE + pos % PAGE).tolist() == reference.k_slots.tolist()


def test_positions_follow_flashinfers_documented_example() -> None:
    # get_batch_indices_positions(append_indptr=[0,1,3,6,10], seq_lens=5) -> [4 | 3,4 | 2,3,4 | 1,2,3,4]
    meta = build_metadata([1, 2, 3, 4], [5] * 4, [[0], [1], [2], [3]], 8)
    args = plan_arguments(meta)
    assert args.positions.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    assert args.batch_indices.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]


def test_auto_picks_torch_on_cpu() -> None:
    assert isinstance(select_backend("auto", CONFIG, torch.device("cpu"), torch.bfloat16), TorchAttention)


def test_forcing_flashinfer_on_cpu_fails_clearly(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flashinfer", CONFIG, torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(EngineConfig(model=str(tiny_checkpoint()), backend="flashinfer", kv_cache_memory_gb=0.01))
    with pytest.raises(ValueError, match="CUDA device"):
        FlashInferAttention(9, 3, 64, torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_forcing_flashinfer_without_the_package_names_the_extra() -> None:
    cuda = torch.device("cuda")  # only compared, never allocated on
    with pytest.raises(ValueError, match=r"specroll\[cuda\]"):
        select_backend("flashinfer", CONFIG, cuda, torch.bfloat16)
    assert isinstance(select_backend("auto", CONFIG, cuda, torch.bfloat16), TorchAttention)


def test_flashinfer_refuses_float32_and_uncompiled_head_sizes() -> None:
    cuda = torch.device("cuda")  # only compared, never allocated on
    with pytest.raises(ValueError, match="float32"):
        select_backend("flashinfer", CONFIG, cuda, torch.float32)
    assert isinstance(select_backend("auto", CONFIG, cuda, torch.float32), TorchAttention)
    odd = msgspec.structs.replace(CONFIG, head_dim=96, num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match="head_dim"):
        select_backend("flashinfer", odd, cuda, torch.bfloat16)


def test_a_flashinfer_that_does_not_import_is_named_and_auto_falls_back(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "flashinfer"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'einops'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"does not import.*einops"):
        select_backend("flashinfer", CONFIG, cuda, torch.bfloat16)
    assert isinstance(select_backend("auto", CONFIG, cuda, torch.bfloat16), TorchAttention)


class StandInKernels:
    """``flashinfer.sampling``'s two entry points on the CPU, by their documented contract (int32
    outputs, -1 padding after the emitted token), computed with the torch reference; lets the GPU
    sampler's grouping and bookkeeping run here."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(0)
        self.calls: list[tuple[int, int]] = []  # (rows, drafts) per chain call

    def sampling_from_probs(self, probs, generator=None):
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1).int()

    def chain_speculative_sampling(self, draft_probs, draft_token_ids, target_probs, generator=None):
        from specroll.engine.spec.verify import chain_rejection_sample

        b, n = draft_token_ids.shape
        self.calls.append((b, n))
        result = chain_rejection_sample(
            target_probs.double(), draft_token_ids.long(), torch.full((b,), n), draft_probs.double(),
            torch.rand(b, n, dtype=torch.float64, generator=self.gen),
            torch.rand(b, dtype=torch.float64, generator=self.gen),
            torch.zeros(b, dtype=torch.bool),
        )
        return result.token_ids.int(), torch.zeros(b, dtype=torch.int32), result.num_accepted.int()


def gpu_sampler_on_cpu():
    from specroll.engine.flashinfer_sampling import FlashInferSampler

    sampler = FlashInferSampler.__new__(FlashInferSampler)  # skips the flashinfer import
    sampler._sampling, sampler.device, sampler.generator = StandInKernels(), torch.device("cpu"), None
    return sampler


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_gpu_sampler_bookkeeping_matches_the_reference(tiny_checkpoint, temperature: float) -> None:
    """Greedy: the same tokens as the CPU path. Sampled: every emitted token's logprob is the
    target's processed logprob (teacher forcing), and draft counts group into one kernel call each."""
    from helpers.checkpoints import teacher_forced_logits

    from specroll.drafter.suffix import SuffixProposer
    from specroll.engine.driver import run_to_completion
    from specroll.engine.sampler import processed_logprobs
    from specroll.protocol.sampling import SamplingParams

    path = tiny_checkpoint("llama")
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(3, 300, (4,), generator=g).tolist() * 9)[:n] for n in (9, 17, 26, 31)]
    sampling = SamplingParams(temperature=temperature, top_k=40, max_tokens=24, ignore_eos=True)

    def run(gpu_path: bool):
        config = EngineConfig(model=str(path), page_size=8, kv_cache_memory_gb=0.01, max_model_len=128,
                              dtype="float32", num_draft_tokens=4)
        engine = Engine(config, proposer=SuffixProposer(min_ngram=1, max_ngram=4))
        if gpu_path:
            engine._gpu_sampler = gpu_sampler_on_cpu()
        for i, p in enumerate(prompts):
            engine.add_request(p, sampling, f"r{i}")
        return engine, run_to_completion(engine)

    engine, done = run(gpu_path=True)
    assert engine.spec_stats.num_accepted > 0
    if temperature == 0.0:
        _, reference = run(gpu_path=False)
        assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in reference.items()}
        return
    assert engine._gpu_sampler._sampling.calls, "no chain speculative sampling call"
    for i, p in enumerate(prompts):
        c = done[f"r{i}"]
        assert len(c.token_ids) == 24
        logits = teacher_forced_logits(engine, p, c.token_ids)
        expected = processed_logprobs(logits, [sampling] * len(c.token_ids))
        expected = expected.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.isfinite(expected).all()
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 1e-4


def test_the_tree_custom_mask_is_flashinfers_flat_layout() -> None:
    """FlashInfer's custom_mask: per request its [q_len, kv_len] mask row-major, requests
    concatenated, True = attend; causal is ignored with it, so causal rows are spelled out."""
    from specroll.engine.flashinfer_attention import tree_custom_mask

    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root with two children
    meta = build_metadata([1, 3, 2], [4, 5, 2], [[0], [1], [2]], 8, {1: tree})
    flat = tree_custom_mask(meta)
    assert flat is not None and flat.dtype == torch.bool and flat.numel() == 1 * 4 + 3 * 5 + 2 * 2
    decode, verify, prefill = flat[:4], flat[4:19].view(3, 5), flat[19:].view(2, 2)
    assert decode.all()
    assert verify.tolist() == [[True, True, True, False, False],  # the root: the prefix and itself
                               [True, True, True, True, False],   # child 1: root, itself, not its sibling
                               [True, True, True, False, True]]   # child 2: root and itself
    assert prefill.tolist() == [[True, False], [True, True]]  # plain causal
    assert tree_custom_mask(build_metadata([3], [5], [[0]], 8)) is None  # no tree: FlashInfer's causal=True
