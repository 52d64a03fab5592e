"""Tree speculation through the engine: drafts as a tree, verified in one target forward, lossless.

The trees here come from stand-in proposers (an oracle that knows the plain run's tokens and puts a
decoy sibling before each of them, and fixed trees), so acceptance is high and the K/V of accepted
nodes that sit after rejected siblings has to be moved into place; the EAGLE head's own trees are
checked for shape. Losslessness is checked three ways: greedy output equals plain greedy output,
sampled output equals plain sampling with the same seeds (the tree walk draws one uniform per
emitted token, as plain sampling does), and chi-square tests on the distribution of emitted
tokens, which a deliberately biased verifier fails (``test_tree_chi_square.py``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import engines
from helpers.checkpoints import teacher_forced_logits
from helpers.engines import StandIn
from helpers.trees import PAGE, eagle_engine, prompts, run

from specroll.engine.config import EngineConfig
from specroll.engine.sampler import processed_logprobs
from specroll.engine.spec.tree import DraftTree, TreeShape, cap_tree, valid_tree
from specroll.protocol.sampling import SamplingParams


class Oracle(StandIn):
    """Drafts each request's known future (from a plain run), a decoy sibling before every node."""

    def __init__(self, futures: dict[str, list[int]], vocab: int, decoys: bool = True) -> None:
        self.futures, self.vocab, self.decoys = futures, vocab, decoys

    def propose_tree(self, batch, shape: TreeShape) -> list[DraftTree]:
        trees = []
        for seq in batch:
            future = self.futures[seq.request_id][len(seq.token_ids) : len(seq.token_ids) + shape.depth]
            tokens, parents, parent = [], [], -1
            for t in future:
                if self.decoys:
                    tokens.append((t + 1) % self.vocab)
                    parents.append(parent)
                tokens.append(t)
                parents.append(parent)
                parent = len(tokens) - 1
            trees.append(DraftTree(tokens[: shape.nodes], parents[: shape.nodes]))
        return trees


make_engine = functools.partial(engines.make_engine, **engines.TREE_SPECULATION)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=11),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, ignore_eos=True, seed=5),
], ids=["greedy", "t1", "topk_topp"])
@pytest.mark.parametrize("groups", [False, True])
def test_tree_output_equals_plain_decoding_and_keeps_only_the_accepted_path(tiny_checkpoint, sampling, groups):
    path = tiny_checkpoint("llama")
    lengths = [PAGE * m - j for m in (2, 3) for j in range(0, 6, 2)]  # trees cross page boundaries
    batch = prompts(lengths)
    plain = run(make_engine(path), batch, sampling, groups)
    futures = {r: batch[int(r[1:])] + c.token_ids for r, c in plain.items()}
    engine = make_engine(path, Oracle(futures, 512))
    tree = run(engine, batch, sampling, groups)
    assert {r: c.token_ids for r, c in tree.items()} == {r: c.token_ids for r, c in plain.items()}
    for r, c in tree.items():
        assert c.logprobs == pytest.approx(plain[r].logprobs, abs=1e-4)
    stats = engine.spec_stats
    # nearly every true node is accepted, after its rejected decoy sibling: accepted K/V was moved
    assert stats.num_accepted > 0.8 * stats.num_drafted / 2
    assert stats.acceptance_length > 3
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_tree_logprobs_equal_teacher_forcing(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    sampling = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=2)
    batch = prompts([9, 17])
    plain = run(make_engine(path), batch, sampling)
    futures = {r: batch[int(r[1:])] + c.token_ids for r, c in plain.items()}
    done = run(make_engine(path, Oracle(futures, 512)), batch, sampling)
    reference = make_engine(path)
    for i, p in enumerate(batch):
        c = done[f"r{i}"]
        logits = teacher_forced_logits(reference, p, c.token_ids)
        expected = processed_logprobs(logits, [sampling] * len(c.token_ids))
        expected = expected.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 1e-4


# ---- shapes, trimming, config ------------------------------------------------------------------

def test_tree_shape_parsing_and_errors():
    assert TreeShape.parse("5x4:16") == TreeShape(5, 4, 16)
    for bad, match in (("5x4", "DEPTHxWIDTH:NODES"), ("ax4:16", "DEPTHxWIDTH:NODES"), ("0x4:16", "depth=0"),
                       ("5x4:65", "at most 64"), ("9x2:8", "depth=9 exceeds nodes=8"),
                       ("4x4:1_2", "DEPTHxWIDTH:NODES"), ("4x4: 12", "DEPTHxWIDTH:NODES"), ("+4x4:12", "DEPTHxWIDTH")):
        with pytest.raises(ValueError, match=match):
            TreeShape.parse(bad)
    with pytest.raises(ValueError, match="draft_trees"):
        EngineConfig(draft_trees=(5,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'3x3'"):
        EngineConfig(draft_trees=("3x3",))
    with pytest.raises(ValueError, match="needs at least one"):
        EngineConfig(draft_length="tree", draft_trees=())


def test_a_malformed_tree_is_cut_before_its_first_bad_node():
    shape = TreeShape(3, 2, 6)
    good = DraftTree([10, 11, 12, 13], [-1, -1, 0, 2])
    assert valid_tree(good, shape, 100) == good
    assert valid_tree(DraftTree([10, 11, 12, 13], [-1, -1, 0, 3]), shape, 100).tokens == [10, 11, 12]  # parent ahead
    assert valid_tree(DraftTree([10, 10, 12], [-1, -1, 0]), shape, 100).tokens == [10]  # repeated sibling
    assert valid_tree(DraftTree([10, 200], [-1, 0]), shape, 100).tokens == [10]  # out of vocabulary
    assert valid_tree(DraftTree([1, 2, 3, 4], [-1, 0, 1, 2]), shape, 100).tokens == [1, 2, 3]  # too deep
    assert len(valid_tree(DraftTree(list(range(8)), [-1] * 8), shape, 100)) == 6  # too many nodes
    capped = cap_tree(DraftTree([1, 2, 3, 4], [-1, 0, -1, 2]), max_depth=1, max_nodes=9)
    assert (capped.tokens, capped.parents) == ([1, 3], [-1, -1])
    capped = cap_tree(DraftTree([1, 2, 3, 4], [-1, -1, 0, 1]), max_depth=2, max_nodes=3)
    assert (capped.tokens, capped.parents) == ([1, 2, 3], [-1, -1, 0])


def test_a_proposer_without_trees_is_refused_for_draft_length_tree(tiny_checkpoint):
    from specroll.drafter.suffix import SuffixProposer

    with pytest.raises(ValueError, match="drafts chains only"):
        make_engine(tiny_checkpoint("llama"), SuffixProposer())


def test_trees_near_the_length_limit_never_pass_it(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    sampling = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=1)
    batch = prompts([30, 31, 32])
    plain = run(make_engine(path, max_model_len=40), batch, sampling)
    futures = {r: batch[int(r[1:])] + c.token_ids + [7] * 10 for r, c in plain.items()}  # drafts past the end
    engine = make_engine(path, Oracle(futures, 512), max_model_len=40)
    done = run(engine, batch, sampling)
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert all(len(c.token_ids) == 7 for c in done.values())


def test_a_wide_tree_at_the_context_limit_takes_no_slot_past_it(tiny_checkpoint):
    # a tree's nodes take a K/V slot each while its depth stays within the limit: near
    # max_model_len (not a page multiple) the nodes must be cut to the slots the context has
    path = tiny_checkpoint("llama")
    sampling = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    batch = prompts([30, 33, 36])
    plain = run(make_engine(path, max_model_len=43), batch, sampling)
    futures = {r: batch[int(r[1:])] + c.token_ids + [7] * 10 for r, c in plain.items()}
    engine = make_engine(path, Oracle(futures, 512), max_model_len=43, draft_trees=("6x4:12",))
    done = run(engine, batch, sampling)
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert sorted(len(c.token_ids) for c in done.values()) == [7, 10, 13]


def test_adaptive_speculation_tries_tree_shapes_and_keeps_greedy_output(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    batch = prompts([11, 20])
    plain = run(make_engine(path), batch, greedy)
    futures = {r: batch[int(r[1:])] + c.token_ids for r, c in plain.items()}
    engine = make_engine(path, Oracle(futures, 512), draft_length="adaptive", draft_trees=("3x2:6", "5x2:10"))
    chosen = []
    original = engine._choose_speculation
    engine._choose_speculation = lambda: chosen.append(original()) or chosen[-1]  # type: ignore[method-assign]
    done = run(engine, batch, greedy)
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert {TreeShape(3, 2, 6), TreeShape(5, 2, 10), 0, 4} <= set(chosen)


# ---- the EAGLE head's trees --------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["4x1:4", "3x3:12", "5x4:16"])
def test_eagle_trees_are_well_formed_and_lossless(tiny_checkpoint, shape):
    path = tiny_checkpoint("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = prompts([9, 16, 23])
    plain = run(make_engine(path), batch, greedy)
    engine, proposer = eagle_engine(path, shape)
    limit = TreeShape.parse(shape)
    seen = []
    original = proposer.propose_tree

    def recording(b, s):
        trees = original(b, s)
        seen.extend(trees)
        return trees

    proposer.propose_tree = recording  # type: ignore[method-assign]
    done = run(engine, batch, greedy, groups=True)
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    drafted = [t for t in seen if len(t)]
    assert drafted and engine.spec_stats.num_drafted > 0
    for tree in drafted:
        depths = tree.depths()
        assert len(tree) <= limit.nodes and max(depths) <= limit.depth
        assert all(p < i for i, p in enumerate(tree.parents))  # parents first
        siblings = [(p, t) for p, t in zip(tree.parents, tree.tokens, strict=True)]
        assert len(set(siblings)) == len(siblings)
        assert all(p < 0 or tree.draft_probs[i] <= 1 for i, p in enumerate(tree.parents))
    if limit.width + (limit.depth - 1) * limit.width ** 2 <= limit.nodes:  # every candidate is kept
        assert max(max(t.depths()) for t in drafted) == limit.depth
    assert proposer.block_manager.num_free_pages == proposer.block_manager.num_pages - sum(
        len(s.block_table) for s in proposer._states.values())


def test_an_eagle_chain_tree_drafts_what_greedy_chain_drafting_drafts(tiny_checkpoint):
    """A tree of width 1 is a chain: the head's tree passes (positions by depth) must draft the
    tokens its chain steps draft. In a wide tree, a node's children are the chain's next draft
    after that node: the last first-level node (whose row comes after its siblings' in the head's
    pass) attends to its ancestors only, not to its siblings."""
    path = tiny_checkpoint("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batch = prompts([10, 19])
    engine, proposer = eagle_engine(path, "4x1:4")
    original_tree, original_draw = proposer.propose_tree, proposer._draw
    forced: dict[int, int] = {}
    compared = []

    def draw(last, params, sampled, states, probs, rows, i):
        tokens = original_draw(last, params, sampled, states, probs, rows, i)
        if i == 0 and forced:
            tokens = torch.tensor([forced[b] for b in rows], device=tokens.device)
        return tokens

    proposer._draw = draw  # type: ignore[method-assign]

    def fresh(run_it):
        state = {r: (s.num_computed_tokens, s.num_features, list(s.pending)) for r, s in proposer._states.items()}
        out = run_it()
        for r, (computed, features, pending) in state.items():
            s = proposer._states[r]
            proposer.block_manager.truncate(s, computed)
            s.num_computed_tokens, s.num_features, s.pending = computed, features, pending
        return out

    def checking(b, shape):
        wide = fresh(lambda: original_tree(b, TreeShape(2, 3, 12)))
        last_first = {j: [t for t, p in zip(w.tokens, w.parents, strict=True) if p < 0][-1]
                      for j, w in enumerate(wide) if len(w)}
        forced.update(last_first)
        forced_chain = fresh(lambda: proposer.propose(b, 2).token_ids.tolist()) if forced else []
        forced.clear()
        chain = fresh(lambda: proposer.propose(b, 4).token_ids.tolist())
        trees = original_tree(b, shape)
        for j, tree in enumerate(trees):
            if len(tree):
                assert tree.tokens == chain[j][: len(tree)]
                assert tree.parents == list(range(-1, len(tree) - 1))
                w = wide[j]
                node = w.tokens.index(last_first[j])
                children = [t for t, p in zip(w.tokens, w.parents, strict=True) if p == node]
                assert children[0] == forced_chain[j][1]
                compared.append(j)
        return trees

    proposer.propose_tree = checking  # type: ignore[method-assign]
    run(engine, batch, greedy)
    assert len(compared) >= 4
