"""The suffix proposer drafts from its own context, group siblings and earlier rollouts."""

from __future__ import annotations

import pytest

from specroll.drafter.suffix import SuffixProposer
from specroll.engine.spec.proposer import DraftInput
from specroll.protocol.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def drafts(proposer: SuffixProposer, seqs: list[DraftInput], k: int) -> list[list[int]]:
    out = proposer.propose(seqs, k)
    assert out.probs is None and out.token_ids.shape == (len(seqs), k)
    return [row[:n].tolist() for row, n in zip(out.token_ids, out.num_drafts, strict=True)]


def test_own_context_repeats_are_drafted_from_the_longest_match():
    p = SuffixProposer(min_ngram=2, max_ngram=4)
    # "5 6 7 8 9" appeared before; the sequence now ends in "6 7" again -> propose "8 9 ...".
    seq = DraftInput("a", None, [1, 5, 6, 7, 8, 9, 2, 3, 6, 7], GREEDY)
    assert drafts(p, [seq], 3) == [[8, 9, 2]]
    # A longer match wins over a shorter, more recent one: "1 6 7" occurs twice with different tails.
    seq = DraftInput("b", None, [1, 6, 7, 40, 2, 6, 7, 50, 1, 6, 7], GREEDY)
    assert drafts(p, [seq], 2) == [[40, 2]]


def test_no_match_or_zero_k_drafts_nothing():
    p = SuffixProposer()
    assert drafts(p, [DraftInput("a", None, [1, 2, 3, 4], GREEDY)], 4) == [[]]
    assert drafts(p, [DraftInput("b", None, [1, 2, 1, 2], GREEDY)], 0) == [[]]


def test_siblings_and_incremental_updates():
    p = SuffixProposer(min_ngram=2, max_ngram=3)
    prompt = [100, 101, 102]
    first = DraftInput("g#0", "g", [*prompt, 7, 8, 9, 10, 11], GREEDY)
    second = DraftInput("g#1", "g", [*prompt, 3, 7, 8], GREEDY)
    stranger = DraftInput("h#0", "h", [*prompt, 3, 7, 8], GREEDY)
    assert drafts(p, [first, second, stranger], 3) == [[], [9, 10, 11], []]
    # The sibling grows; the next call sees its new tokens.
    # Now the sibling ends in "7 8" itself: its own earlier "7 8 9 10" is drafted, and the other
    # sample skips the occurrence with nothing after it.
    first = DraftInput("g#0", "g", [*first.token_ids, 12, 7, 8], GREEDY)
    assert drafts(p, [first, second], 2) == [[9, 10], [9, 10]]


def test_earlier_rollouts_of_the_prompt_are_remembered_and_evicted_oldest_first():
    p = SuffixProposer(min_ngram=2, max_ngram=3, max_rollouts_per_prompt=2)
    for i, tail in enumerate(([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8])):
        p.propose([DraftInput(f"old{i}", "q", [50, 51, *tail], GREEDY)], 1)
        p.finish(f"old{i}")
    new = DraftInput("new", "q", [50, 51, 1, 2], GREEDY)
    assert drafts(p, [new], 2) in ([[5, 6]], [[7, 8]])  # the two newest are kept...
    p.finish("new")
    gone = DraftInput("probe", "q", [9, 9, 2, 3], GREEDY)
    assert drafts(p, [gone], 1) == [[]]  # ...and the oldest ([.. 2 3 4]) was evicted
    other = DraftInput("other", "r", [50, 51, 1, 2], GREEDY)
    assert drafts(p, [other], 2) == [[]]  # another prompt's history is not used


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_ngram=3, max_ngram=2"):
        SuffixProposer(min_ngram=3, max_ngram=2)
