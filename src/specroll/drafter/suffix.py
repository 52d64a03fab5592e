"""Model-free drafting by suffix matching (prompt-lookup / n-gram decoding, extended for RL).

The last n tokens of a sequence (n from ``max_ngram`` down to ``min_ngram``) are looked up in
(a) the sequence's own earlier context, (b) its group siblings — the other samples of the same
prompt, which often repeat each other's reasoning — and (c) earlier rollouts of the same prompt from
previous RL steps, kept per prompt with bounded memory and evicted oldest first. The tokens that
followed the longest match are proposed (one-hot q). The idea is prompt-lookup decoding (Saxena
2023) and the suffix-tree speculation of SuffixDecoding (Oliaro et al. 2024), here with hash maps.

Each indexed sequence keeps a map from every n-gram (``min_ngram ≤ n ≤ max_ngram``) to the position
just after its latest occurrence (and the one before, for the sequence's own suffix), updated
incrementally as tokens arrive, so a lookup costs O(max_ngram) dictionary probes per indexed
sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from specroll.engine.model import CausalLM
from specroll.engine.spec.proposer import DraftInput, FeatureUpdate, Proposal


class _NgramIndex:
    """n-gram → position after its latest occurrence, for one growing token sequence."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self.next_pos: dict[tuple[int, ...], int] = {}
        self.prev_pos: dict[tuple[int, ...], int] = {}  # the occurrence before the latest

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                ngram = tuple(self.tokens[end - n : end])
                latest = self.next_pos.get(ngram)
                if latest is not None:
                    self.prev_pos[ngram] = latest
                self.next_pos[ngram] = end

    def continuation(self, ngram: tuple[int, ...], k: int) -> list[int]:
        """Up to k tokens that followed ``ngram``'s latest occurrence with something after it."""
        pos = self.next_pos.get(ngram)
        if pos is not None and pos >= len(self.tokens):  # nothing follows yet: the one before
            pos = self.prev_pos.get(ngram)
        return [] if pos is None else self.tokens[pos : pos + k]


class SuffixProposer:
    """Suffix-matching proposer over own context, group siblings and past rollouts of a prompt.

    Args:
        min_ngram: shortest suffix that counts as a match.
        max_ngram: longest suffix tried (the longest match wins).
        max_rollouts_per_prompt: finished rollouts remembered per prompt (oldest evicted first).
        max_prompts: prompts remembered (least recently used evicted first).

    Raises:
        ValueError: when the n-gram range or a bound is not positive.
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 8, max_rollouts_per_prompt: int = 16,
                 max_prompts: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: expected 1 <= min <= max")
        if max_rollouts_per_prompt < 0 or max_prompts <= 0:
            raise ValueError(
                f"max_rollouts_per_prompt={max_rollouts_per_prompt}, max_prompts={max_prompts}: "
                "expected >= 0 and > 0"
            )
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.max_rollouts_per_prompt = max_rollouts_per_prompt
        self.max_prompts = max_prompts
        self._live: dict[str, _NgramIndex] = {}
        self._group_of: dict[str, str | None] = {}
        self._history: OrderedDict[str, deque[_NgramIndex]] = OrderedDict()

    feature_layers: tuple[int, ...] = ()
    """Model-free: reads no target features."""

    def attach(self, target: CausalLM) -> None:
        """Model-free: nothing to bind."""

    def observe(self, updates: Sequence[FeatureUpdate]) -> None:
        """Model-free: never called (no ``feature_layers``)."""

    def _index_of(self, seq: DraftInput) -> _NgramIndex:
        index = self._live.get(seq.request_id)
        if index is None:
            index = self._live[seq.request_id] = _NgramIndex(self.min_ngram, self.max_ngram)
            self._group_of[seq.request_id] = seq.group_id
        index.extend(seq.token_ids[len(index.tokens) :])
        return index

    def finish(self, request_id: str) -> None:
        """Forget a live sequence; keep it as an earlier rollout of its prompt when it has a group."""
        index = self._live.pop(request_id, None)
        group = self._group_of.pop(request_id, None)
        if index is None or group is None or self.max_rollouts_per_prompt == 0:
            return
        history = self._history.setdefault(group, deque(maxlen=self.max_rollouts_per_prompt))
        history.append(index)  # a full deque drops its oldest rollout
        self._history.move_to_end(group)
        while len(self._history) > self.max_prompts:
            self._history.popitem(last=False)

    def propose(self, batch: Sequence[DraftInput], k: int) -> Proposal:
        """Draft up to ``k`` tokens per sequence by the longest suffix match (one-hot q)."""
        indexes = [self._index_of(seq) for seq in batch]
        drafts = torch.zeros(len(batch), k, dtype=torch.long)
        num = torch.zeros(len(batch), dtype=torch.long)
        for b, (seq, own) in enumerate(zip(batch, indexes, strict=True)):
            others = [idx for rid, idx in self._live.items()
                      if idx is not own and seq.group_id is not None and self._group_of[rid] == seq.group_id]
            others += self._history.get(seq.group_id, ()) if seq.group_id is not None else []
            found = self._match(own, others, k) if k > 0 else []
            drafts[b, : len(found)] = torch.tensor(found, dtype=torch.long)
            num[b] = len(found)
        return Proposal(drafts, num, None)

    def _match(self, own: _NgramIndex, others: list[_NgramIndex], k: int) -> list[int]:
        tokens = own.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tuple(tokens[-n:])
            # Own context: an earlier occurrence (the suffix itself ends at len(tokens)).
            prior = _latest_before(own, suffix, len(tokens))
            best = own.tokens[prior : prior + k] if prior is not None else []
            for other in others:
                cont = other.continuation(suffix, k)
                if len(cont) > len(best):
                    best = cont
            if best:
                return best
        return []


def _latest_before(index: _NgramIndex, ngram: tuple[int, ...], end: int) -> int | None:
    """Position after the latest occurrence of ``ngram`` ending before ``end`` (the sequence's own
    suffix is its latest occurrence, so the one before it is used)."""
    pos = index.next_pos.get(ngram)
    if pos is not None and pos >= end:
        pos = index.prev_pos.get(ngram)
    return pos
