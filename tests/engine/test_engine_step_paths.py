"""Engine steps in which some or none of the batch samples: a prompt longer than the step's token
budget is prefilled in chunks, and a chunk that stops short of the prompt's last token samples
nothing — with speculation on, such a step has nothing to verify. Each path runs through
``Engine.step`` and is compared with plain greedy decoding under the same budget."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import engines

from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import EagleConfig, build_draft_vocab
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.suffix import SuffixProposer
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.model_config import ModelConfig
from specroll.engine.spec.proposer import Proposal
from specroll.protocol.sampling import SamplingParams

PAGE, K, BUDGET = 8, 4, 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def eagle(config: ModelConfig) -> EagleProposer:
    counts = torch.arange(config.vocab_size, 0, -1).float()
    head = EagleHead.init(EagleConfig.for_target(config, (config.num_layers,), 200), build_draft_vocab(counts, 200))
    return EagleProposer(head, page_size=PAGE, kv_cache_memory_gb=0.01)


class RepeatLast:
    """Drafts the last token k times for every sequence (one-hot q): always a full chain to verify."""

    feature_layers: tuple[int, ...] = ()

    def attach(self, target) -> None:
        pass

    def propose(self, batch, k: int) -> Proposal:
        ids = torch.tensor([[seq.token_ids[-1]] * k for seq in batch], dtype=torch.long).view(len(batch), k)
        return Proposal(ids, torch.full((len(batch),), k, dtype=torch.long), None)

    def observe(self, updates) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass


SPECULATION = {
    "suffix-chain": (lambda cfg: SuffixProposer(min_ngram=1, max_ngram=4), "fixed"),
    "repeat-chain": (lambda cfg: RepeatLast(), "fixed"),
    "eagle-chain": (eagle, "fixed"),
    "eagle-tree": (eagle, "tree"),
    "eagle-adaptive": (eagle, "adaptive"),
}


make_engine = functools.partial(engines.make_engine, num_draft_tokens=K, max_num_batched_tokens=BUDGET,
                                draft_trees=("4x2:8",))


def speculating(path, speculation: str) -> Engine:
    """An engine drafting as ``SPECULATION[speculation]`` says, its proposer built for the model it loaded."""
    build, draft_length = SPECULATION[speculation]
    engine = make_engine(path, draft_length=draft_length)
    engine.set_proposer(build(engine.model_config))
    return engine


def motif_prompt(n: int, seed: int = 0) -> list[int]:
    """Repeated motifs, so the suffix proposer drafts."""
    motif = torch.randint(3, 300, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (motif * (n // 7 + 1))[:n]


def plain(path, prompts: dict[str, list[int]], sampling: SamplingParams = GREEDY) -> dict[str, list[int]]:
    engine = make_engine(path)
    for rid, p in prompts.items():
        engine.add_request(p, sampling, rid)
    return {rid: c.token_ids for rid, c in run_to_completion(engine).items()}


@pytest.mark.parametrize("speculation", list(SPECULATION))
def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_with_speculation_on(tiny_checkpoint, speculation):
    path = tiny_checkpoint("llama")
    prompt = motif_prompt(100)  # 100 tokens, 32 a step: three steps in which nothing samples
    engine = speculating(path, speculation)
    engine.add_request(prompt, GREEDY, "long")
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    assert steps[:3] == [[], [], []], "a partial prefill chunk emits nothing"
    tokens = [t for outs in steps for o in outs for t in o.new_token_ids]
    assert tokens == plain(path, {"long": prompt})["long"]
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("speculation", ["repeat-chain", "eagle-chain", "eagle-tree", "eagle-adaptive"])
def test_a_chunked_prefill_beside_drafting_decodes(tiny_checkpoint, speculation):
    """Decodes that carry drafts (a chain or a tree) share steps with another prompt's prefill
    chunks, which take what is left of the budget and sample nothing until the last."""
    path = tiny_checkpoint("llama")
    short, long = motif_prompt(12, seed=1), motif_prompt(90, seed=2)
    engine = speculating(path, speculation)
    engine.add_request(short, GREEDY, "short")
    out: dict[str, list[int]] = {"short": [], "long": []}
    for o in engine.step():  # the short prompt's prefill: it decodes from the next step on
        out[o.request_id].extend(o.new_token_ids)
    engine.add_request(long, GREEDY, "long")
    mixed = 0
    while engine.has_unfinished():
        long_seq = engine._requests.get("long")
        before = long_seq.num_computed_tokens if long_seq is not None else None
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if before is not None and before < len(long) - BUDGET and engine.last_step_stats.num_drafted:
            mixed += 1  # a partial chunk of the long prompt ran beside verified drafts
    assert out == plain(path, {"short": short, "long": long})
    if speculation != "eagle-adaptive":  # the bandit may choose k = 0 for these steps
        assert mixed > 0, "no step mixed a partial prefill chunk with drafts"
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_a_tree_step_whose_drafts_the_length_cap_all_cut(tiny_checkpoint):
    """Requests one token from their length limit may verify no draft (``draft_cap`` = 0): the tree
    step has decodes, no tree, and a prefill chunk that samples nothing beside them."""
    path = tiny_checkpoint("llama")
    capped = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompts = {"a": motif_prompt(10, seed=3), "b": motif_prompt(11, seed=4)}
    long = motif_prompt(80, seed=5)
    engine = speculating(path, "eagle-tree")
    for rid, p in prompts.items():
        engine.add_request(p, capped, rid)
    first = engine.step()  # both prefills, one token each
    assert sorted(o.request_id for o in first) == ["a", "b"]
    engine.add_request(long, GREEDY, "long")
    second = engine.step()  # a and b at max_len − 1: no drafts; long's first chunk samples nothing
    assert engine.last_step_stats.num_drafted == 0
    assert sorted(o.request_id for o in second) == ["a", "b"] and all(o.finished for o in second)
    rest = run_to_completion(engine)
    expected = plain(path, prompts, capped)
    assert {o.request_id: o.new_token_ids for o in first} == {rid: t[:1] for rid, t in expected.items()}
    assert {o.request_id: o.new_token_ids for o in second} == {rid: t[1:] for rid, t in expected.items()}
    assert rest["long"].token_ids == plain(path, {"long": long})["long"]


@pytest.mark.parametrize("speculation", ["suffix-chain", "eagle-tree"])
def test_every_sequence_aborted_between_steps_mid_prefill_and_mid_draft(tiny_checkpoint, speculation):
    """Abort every request while one is halfway through its prefill chunks and the others decode
    with drafts: the next step has nothing to run, every page is free, the proposer forgot them,
    and a request added afterwards decodes as if nothing had happened."""
    path = tiny_checkpoint("llama")
    engine = speculating(path, speculation)
    engine.add_request(motif_prompt(12, seed=6), GREEDY, "a")
    engine.add_request(motif_prompt(14, seed=7), GREEDY, "b")
    engine.step()
    engine.add_request(motif_prompt(120, seed=8), GREEDY, "long")
    engine.step()
    engine.step()
    assert engine._requests["long"].num_computed_tokens < 120, "the long prompt is still being prefilled"
    done = {rid: engine.abort(rid) for rid in engine.live_request_ids()}
    assert done["long"].token_ids == [] and all(c.finish_reason == "abort" for c in done.values())
    assert engine.step() == [] and not engine.has_unfinished()
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    proposer = engine.proposer
    if isinstance(proposer, EagleProposer):
        assert proposer._states == {}
    fresh = motif_prompt(40, seed=9)
    engine.add_request(fresh, GREEDY, "fresh")
    assert run_to_completion(engine)["fresh"].token_ids == plain(path, {"fresh": fresh})["fresh"]


@pytest.mark.parametrize("speculation", ["repeat-chain", "eagle-adaptive"])
def test_a_first_step_of_one_token_prompts_is_all_decode_sized(tiny_checkpoint, speculation):
    """One-token prompts: the first step's prefill is one token a sequence, the shape of a decode,
    chosen while nothing ran yet (the fixed k, not the adaptive bandit's pick), so it is not credited
    to the bandit; the output is plain greedy's."""
    path = tiny_checkpoint("llama")
    prompts = {f"r{i}": [5 + i] for i in range(3)}
    engine = speculating(path, speculation)
    for rid, p in prompts.items():
        engine.add_request(p, GREEDY, rid)
    assert {rid: c.token_ids for rid, c in run_to_completion(engine).items()} == plain(path, prompts)


def test_a_prompt_many_budgets_long_is_warned_about_once(tiny_checkpoint, caplog):
    engine = make_engine(tiny_checkpoint("llama", max_position_embeddings=512), max_model_len=512)
    with caplog.at_level("WARNING", logger="specroll.engine"):
        engine.add_request(motif_prompt(8 * BUDGET), GREEDY, "eight-steps")  # 8 steps: not warned
        assert not caplog.records
        engine.add_request(motif_prompt(9 * BUDGET), GREEDY, "nine-steps")
        engine.add_request(motif_prompt(10 * BUDGET), GREEDY, "ten-steps")
    assert [r.getMessage() for r in caplog.records] == [
        f"a prompt of {9 * BUDGET} tokens takes 9 steps to prefill under max_num_batched_tokens={BUDGET}; a larger "
        "budget (--max-num-batched-tokens, generator.engine.max_num_batched_tokens) prefills it in fewer, faster "
        "steps (warned once)"]
