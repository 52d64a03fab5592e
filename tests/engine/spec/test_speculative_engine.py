"""Speculative decoding inside the engine: lossless for greedy, exact logprobs, K/V rolled back."""

from __future__ import annotations

import functools

import msgspec
import pytest
import torch
from helpers import engines
from helpers.checkpoints import teacher_forced_logits
from helpers.trees import run

from specroll.drafter.suffix import SuffixProposer
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.sampler import processed_logprobs
from specroll.protocol.sampling import SamplingParams

PAGE, K = 8, 4


make_engine = functools.partial(engines.make_engine, num_draft_tokens=K)  # every engine here drafts up to K tokens


def suffix() -> SuffixProposer:
    return SuffixProposer(min_ngram=1, max_ngram=4)


def repetitive_prompts(lengths: list[int]) -> list[list[int]]:
    """Prompts made of repeated motifs, so suffix matching drafts often (accepted or not)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        motif = torch.randint(3, 300, (5,), generator=g).tolist()
        out.append((motif * (n // 5 + 1))[:n])
    return out


@pytest.mark.parametrize("groups", [False, True])
def test_greedy_speculative_equals_greedy_plain_across_page_boundaries(tiny_checkpoint, groups):
    path = tiny_checkpoint("llama")
    lengths = [PAGE * m - j for m in (2, 3) for j in range(K + 1)]  # page_size·m − j, j = 0..k
    prompts = repetitive_prompts(lengths)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = run(make_engine(path), prompts, greedy, groups)
    spec_engine = make_engine(path, suffix())
    spec = run(spec_engine, prompts, greedy, groups)
    assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids for r, c in plain.items()}
    for r, c in spec.items():
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 20
        assert c.logprobs == pytest.approx(plain[r].logprobs, abs=1e-4)
    stats = spec_engine.spec_stats
    assert stats.num_drafted > 0 and 0 < stats.num_accepted < stats.num_drafted
    assert spec_engine.block_manager.num_free_pages == spec_engine.block_manager.num_pages


def test_sampled_speculative_logprobs_equal_teacher_forcing(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts([13, 21, 30])
    sampling = SamplingParams(temperature=0.8, top_k=30, top_p=0.95, max_tokens=24, seed=3, ignore_eos=True)
    engine = make_engine(path, suffix())
    done = run(engine, prompts, sampling)
    assert engine.spec_stats.num_drafted > 0
    reference = make_engine(path)
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
    engine = make_engine(path, suffix(), max_model_len=len(prompt) + 9)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), "r")
    bm = engine.block_manager
    while engine.has_unfinished():
        outputs = engine.step()
        for seq in engine.scheduler.running:  # after rollback, pages hold exactly the valid K/V
            assert len(seq.block_table) == bm.pages_needed(seq.num_computed_tokens)
    (out,) = outputs
    assert out.finish_reason == "length" and out.num_output_tokens == 9
    assert engine.spec_stats.num_drafted > engine.spec_stats.num_accepted > 0


class SkewedProposer:
    """Drafts one token per request from a fixed q chosen by the request id's parity and passes q on
    (a test implementation of the protocol)."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, q_even: torch.Tensor, q_odd: torch.Tensor) -> None:
        self.qs = (q_even, q_odd)  # [V] each
        self.generator = torch.Generator().manual_seed(7)

    def attach(self, target) -> None:
        pass

    def observe(self, updates) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass

    def propose(self, batch, k):
        from specroll.engine.spec.proposer import Proposal

        probs = torch.stack([self.qs[int(seq.request_id[1:]) % 2] for seq in batch])[:, None, :]  # [B, 1, V]
        drafts = torch.multinomial(probs[:, 0], 1, generator=self.generator)  # [B, 1]
        return Proposal(drafts, torch.ones(len(batch), dtype=torch.long), probs)


def skewed(p: torch.Tensor, favoured: int) -> torch.Tensor:
    """0.7 on ``favoured``, 0.3 spread over the target's nine next most likely tokens."""
    q = torch.zeros_like(p)  # [V]
    others = [t for t in torch.argsort(p, descending=True).tolist() if t != favoured][:9]
    q[others] = 0.3 / len(others)
    q[favoured] = 0.7
    return q


def test_the_engine_verifies_sampled_drafts_against_the_proposers_q(tiny_checkpoint):
    """A one-token prompt decodes (and drafts) at its first step: the first emitted token must follow
    the target's p, and drafts pass at the rate sum(min(p, q)) only if each row is verified against
    its own q (one-hot q would give sum(p·q); another row's q would skew the output)."""
    path = tiny_checkpoint("llama")
    reference = make_engine(path)
    p = torch.softmax(teacher_forced_logits(reference, [5], [0])[0], -1).double()  # [V] target, first step
    ranked = torch.argsort(p, descending=True).tolist()
    q_even, q_odd = skewed(p, ranked[0]), skewed(p, ranked[1])
    n = 3000
    engine = make_engine(path, SkewedProposer(q_even.float(), q_odd.float()), kv_cache_memory_gb=0.05,
                         max_model_len=64, num_draft_tokens=1, max_num_seqs=256)
    sampling = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    for i in range(n):
        engine.add_request([5], msgspec.structs.replace(sampling, seed=i), f"r{i}")
    done = run_to_completion(engine)
    assert engine.spec_stats.num_drafted == n
    accept_rate = (torch.minimum(p, q_even).sum() + torch.minimum(p, q_odd).sum()).item() / 2
    tolerance = 4 * (accept_rate * (1 - accept_rate) / n) ** 0.5
    assert abs(engine.spec_stats.num_accepted / n - accept_rate) < tolerance
    first = torch.tensor([done[f"r{i}"].token_ids[0] for i in range(n)])
    observed = torch.bincount(first, minlength=p.numel()).double()
    expected = p * n
    big = expected >= 5  # Pearson's test needs expected counts of about 5 or more: pool the rest
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum()
    p_value = float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64), stat / 2))
    assert p_value > 1e-3, p_value


@pytest.mark.parametrize("drafter", ["suffix", "eagle"])
def test_aborts_between_speculative_steps_leave_the_others_unchanged(tiny_checkpoint, drafter):
    from helpers.drafters import make_head

    from specroll.drafter.eagle import EagleProposer
    from specroll.engine.loaders.checkpoint import load_checkpoint

    path = tiny_checkpoint("llama")

    def build() -> Engine:
        if drafter == "suffix":
            return make_engine(path, suffix())
        head = make_head(load_checkpoint(str(path)).config, draft_vocab=320)
        return make_engine(path, EagleProposer(head, page_size=PAGE, kv_cache_memory_gb=0.01))

    prompts = repetitive_prompts([13, 21, 30, 17, 25])
    sampling = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    engine = build()
    for i, p in enumerate(prompts):
        engine.add_request(p, msgspec.structs.replace(sampling, seed=i), f"r{i}")
    again = build()
    for i, p in enumerate(prompts):
        again.add_request(p, msgspec.structs.replace(sampling, seed=i), f"r{i}")
    reference = run_to_completion(again)
    terminal: dict[str, int] = {}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    aborted: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in aborted, "an aborted request produced more output"
            tokens[out.request_id].extend(out.new_token_ids)
            terminal[out.request_id] = terminal.get(out.request_id, 0) + out.finished
        step += 1
        if step in (3, 5):  # after drafts were verified and rolled back at least once
            rid = f"r{step // 2}"
            completion = engine.abort(rid)
            assert completion.finish_reason == "abort" and completion.token_ids == tokens[rid]
            aborted[rid] = completion.token_ids
            terminal[rid] = terminal.get(rid, 0) + 1
    assert engine.spec_stats.num_drafted > 0
    assert terminal == {rid: 1 for rid in tokens}  # exactly one terminal output each
    for rid, c in reference.items():
        if rid in aborted:
            assert c.token_ids[: len(aborted[rid])] == aborted[rid]
        else:
            assert tokens[rid] == c.token_ids
    if drafter == "eagle":
        proposer = engine.proposer
        assert isinstance(proposer, EagleProposer) and not proposer._states
        assert proposer.block_manager.num_free_pages == proposer.block_manager.num_pages


def test_adaptive_draft_length_tries_every_k_and_keeps_greedy_output(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts([13, 21, 30, 17])
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run(make_engine(path), prompts, greedy)
    engine = make_engine(path, suffix(), draft_length="adaptive")
    chosen: list[int] = []
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy, f"r{i}")
    done = run_to_completion(engine, on_step=lambda _: chosen.append(engine.last_step_stats.k))
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert set(chosen) == set(range(K + 1))  # each arm is tried (0 = plain decoding)
    assert engine.spec_stats.num_steps == len(chosen)


def test_sequences_without_drafts_sample_exactly_as_plain_decoding(tiny_checkpoint):
    from specroll.drafter.replay import ReplayProposer

    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts([13, 21, 30])
    sampling = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=11, ignore_eos=True)
    plain = run(make_engine(path), prompts, sampling)
    never = engines.make_engine(path, ReplayProposer({}))  # knows no rollout: never drafts
    done = run(never, prompts, sampling)
    assert never.spec_stats.num_steps > 0 and never.spec_stats.num_drafted == 0
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}


class BrokenProposer(SkewedProposer):
    """Drafts whose q is not a distribution (NaN, or zero at the draft), or ids outside the vocabulary."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def propose(self, batch, k):
        from specroll.engine.spec.proposer import Proposal

        probs = torch.full((len(batch), k, 320), 1 / 320)
        drafts = torch.full((len(batch), k), 7)
        if self.fault == "nan":
            probs[:, 0, 3] = float("nan")
        elif self.fault == "zero_at_draft":
            probs[:, 0, 7] = 0.0
        else:
            drafts[:, 0] = 320  # one past the vocabulary
        return Proposal(drafts, torch.full((len(batch),), k), None if self.fault == "out_of_vocab" else probs)


@pytest.mark.parametrize("fault", ["nan", "zero_at_draft", "out_of_vocab"])
def test_drafts_after_a_broken_q_or_id_are_dropped_so_output_stays_exact(tiny_checkpoint, fault):
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts([13, 21])
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)
    plain = run(make_engine(path), prompts, sampling)
    broken = make_engine(path, BrokenProposer(fault))
    done = run(broken, prompts, sampling)
    assert broken.spec_stats.num_drafted == 0  # the first draft of every row is bad: nothing verified
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}


def test_pages_filled_by_accepted_drafts_are_shared_through_the_prefix_cache(tiny_checkpoint):
    from specroll.drafter.replay import ReplayProposer

    path = tiny_checkpoint("llama")
    prompt = repetitive_prompts([13])[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    rollout = run(make_engine(path), [prompt], greedy)["r0"].token_ids
    engine = make_engine(path, ReplayProposer({"g": prompt + rollout}))
    engine.add_request(prompt, greedy, "a", group_id="g")
    assert run_to_completion(engine)["a"].token_ids == rollout
    assert engine.spec_stats.num_accepted > 30  # pages were filled by accepted drafts
    # The finished request's pages stay cached: a prompt that continues it reuses every full page.
    follow = prompt + rollout
    engine.add_request(follow, SamplingParams(temperature=0.0, max_tokens=1), "b")
    seq = engine._requests["b"]
    engine.scheduler.schedule(engine.weight_version)
    assert seq.num_computed_tokens == (len(follow) - 1) // PAGE * PAGE


@pytest.mark.parametrize("k", [1, 4])
def test_a_sibling_admitted_with_its_whole_prompt_cached_drafts_only_into_its_pages(tiny_checkpoint, k):
    # page_size 1: the second sample of a group takes every prompt page but the last token's from
    # the prefix cache and is admitted holding exactly one free slot; drafting k tokens into it
    # would pass its pages (the step refused such a batch: "q_len=2, kv_len=39 with 38 pages of 1").
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts([23]) * 2  # one group: the same prompt twice
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = run(make_engine(path, page_size=1), prompts, greedy, groups=True)
    spec_engine = make_engine(path, suffix(), page_size=1, num_draft_tokens=k)
    spec = run(spec_engine, prompts, greedy, groups=True)
    assert {r: c.token_ids for r, c in spec.items()} == {r: c.token_ids for r, c in plain.items()}
    assert spec_engine.spec_stats.num_drafted > 0
