"""EAGLE drafting inside the engine: the head's own paged K/V, fed with the target's features.

After every engine step the target's features of newly verified positions arrive through
:meth:`EagleProposer.observe`; they wait until the request next decodes. :meth:`propose` then runs
one ragged "catch-up" pass of the head over each request's waiting (feature ``f_t``, token
``x_{t+1}``) pairs — the whole prompt on a request's first draft — which ends at the last verified
position and yields the first draft; each further draft is one more head step fed with the head's
own output (EAGLE's autoregressive drafting, arXiv 2401.15077 §4.2). The K/V of those further
steps is dropped afterwards: the next step replaces it with K/V computed from real target features.

Drafts are sampled from the head's distribution q processed like the request's (temperature →
top-k → top-p), and q goes to the verifier, or taken greedily (one-hot q); greedy requests are always
drafted greedily.

``eagle_features.py`` holds what the proposer keeps per request between steps and the prompt
features it shares between requests that hit the target's prefix cache; ``eagle_tree.py`` the
candidate bookkeeping of EAGLE-2's dynamic tree (:meth:`EagleProposer.propose_tree`).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from specroll.drafter.eagle_config import DrafterError, EagleConfig
from specroll.drafter.eagle_features import DraftState, PromptFeatureCache
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.eagle_tree import TreeSearch
from specroll.engine.attention import allocate_kv_cache, kv_bytes_per_page
from specroll.engine.batch import build_metadata
from specroll.engine.block_manager import BlockManager
from specroll.engine.model import CausalLM
from specroll.engine.sampler import draw_inverse_cdf, processed_logprobs
from specroll.engine.spec.proposer import DraftInput, FeatureUpdate, Proposal
from specroll.engine.spec.tree import DraftTree, TreeShape
from specroll.engine.torch_attention import TorchAttention


def head_cache_tokens(config: EagleConfig, kv_cache_memory_gb: float, page_size: int, dtype: torch.dtype) -> int:
    """Positions of head K/V that ``kv_cache_memory_gb`` GiB hold, in whole pages of ``page_size``
    (the head is one decoder layer: ``2 · num_kv_heads · head_dim`` elements of ``dtype`` per position)."""
    page_bytes = kv_bytes_per_page(config.as_model_config(), page_size, dtype)
    return int(kv_cache_memory_gb * 2**30) // page_bytes * page_size


class EagleProposer:
    """Drafts with an :class:`EagleHead` on the engine's target model.

    Args:
        head: the head, or the directory it was saved in.
        sample_drafts: draw drafts from q and verify against it; False drafts greedily (one-hot q).
        kv_cache_memory_gb: memory for the head's paged K/V, in GiB.
        page_size: tokens per page of that cache.
        seed: seeds each request's draft sampling (with its id).
        max_cached_pages: prompt pages of features kept for requests that hit the target's prefix
            cache (least recently used evicted first). ``page_size`` should divide the engine's.

    Raises:
        DrafterError: ``head`` is a path that holds no valid drafter.
    """

    def __init__(self, head: EagleHead | str | Path, *, sample_drafts: bool = True, kv_cache_memory_gb: float = 0.25,
                 page_size: int = 16, seed: int = 0, max_cached_pages: int = 1024) -> None:
        self.source = str(head) if not isinstance(head, EagleHead) else "the drafter"
        self.head = head if isinstance(head, EagleHead) else EagleHead.load(head)
        self.feature_layers = tuple(self.head.config.feature_layers)
        self.sample_drafts = sample_drafts
        self.kv_cache_memory_gb = kv_cache_memory_gb
        self.page_size = page_size
        self.seed = seed
        self._states: dict[str, DraftState] = {}
        self._prompt_features = PromptFeatureCache(page_size, max_cached_pages)
        self._target: CausalLM | None = None
        self.tree_seconds: dict[str, float] = {"catch_up": 0.0, "head_passes": 0.0, "draft_q": 0.0, "build": 0.0}
        """Seconds :meth:`propose_tree` spent in the catch-up pass, the per-depth head passes, the
        draft logits and their processing (q), and the rest (choosing nodes, building the trees),
        summed over calls (host clock: on CUDA without synchronising, so kernel time may land in a
        later part)."""

    # ---- binding --------------------------------------------------------------------------

    def attach(self, target: CausalLM) -> None:
        """Bind to ``target``: check the head fits it, move the head to its device and dtype and
        take the LM-head rows of the draft vocabulary (again after every weight update).

        Raises:
            DrafterError: the head was made for another vocabulary, hidden size or depth.
        """
        self.head.check_target(target.config, self.source)
        weight = target.lm_head_weight
        if self._target is None:
            self.head.to(device=weight.device, dtype=weight.dtype).eval()
            config = self.head.config.as_model_config()
            num_pages = max(1, head_cache_tokens(self.head.config, self.kv_cache_memory_gb, self.page_size,
                                                 weight.dtype) // self.page_size)
            self.kv_cache = allocate_kv_cache(config, num_pages, self.page_size, weight.dtype, weight.device)[0]
            self.block_manager = BlockManager(num_pages, self.page_size, enable_prefix_caching=False)
            self.backend = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim, weight.device)
        self._target = target
        # Draft ids in ascending target order: q is processed and sampled over the draft vocabulary
        # only, and an inverse-CDF draw over ascending ids picks the token the same uniform picks over
        # the whole vocabulary (the other tokens have q = 0 and leave the CDF unchanged).
        self._d2t = self.head.draft_to_target.sort().values  # [draft_vocab] int64, CPU
        # The target's LM-head rows of the draft vocabulary [draft_vocab, H]; an eagle3 head has its
        # own LM head (ids ascending, so its rows are in this order) and reads none.
        own = self.head.lm_head is not None
        self._head_weight = weight.detach()[:0] if own else weight.detach().index_select(0, self._d2t.to(weight.device))

    def load_head(self, head: EagleHead) -> None:
        """Serve ``head``'s weights from the next draft on (a new drafter version, same shape).

        The weights are copied into the served head, so live requests keep their head K/V and
        features: K/V computed by the previous version stays until they finish, which can cost
        acceptance but never correctness (verification is lossless for any draft).

        Raises:
            DrafterError: ``head`` has another config (build a new proposer for it) or another target.
        """
        if head.config != self.head.config:
            raise DrafterError(f"{self.source}: a new version with another shape ({head.config}) cannot be "
                               f"loaded in place of {self.head.config}")
        if self._target is not None:
            head.check_target(self._target.config, self.source)
        self.head.load_state_dict(head.state_dict())  # copies into the served tensors (device, dtype kept)
        if self._target is not None:
            self.attach(self._target)  # the draft vocabulary may have changed: re-take the LM-head rows

    # ---- features -------------------------------------------------------------------------

    def observe(self, updates: Sequence[FeatureUpdate]) -> None:
        """Queue target features of newly verified positions (see :class:`FeatureUpdate`)."""
        for u in updates:
            state = self._state(u.request_id)
            if u.start == 0:
                state.usable = True  # a full recompute (or the first prefill) starts afresh
            if u.start < state.num_features:
                self._rewind(state, u.start)
            if u.start > state.num_features:
                prefix = self._prompt_features.prefix(u.token_ids, u.start) if state.num_features == 0 else None
                if prefix is None:
                    state.usable = False
                    continue
                state.pending.append(prefix)
                state.num_features = u.start
            state.pending.append(u.features)
            state.num_features += u.features.shape[0]
            self._prompt_features.remember(state, u)

    def _state(self, request_id: str) -> DraftState:
        state = self._states.get(request_id)
        if state is None:
            g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{request_id}".encode()))
            state = self._states[request_id] = DraftState(request_id, g)
        return state

    def _rewind(self, state: DraftState, position: int) -> None:
        """Forget features (and head K/V) from ``position`` on."""
        if position < state.num_computed_tokens:
            self.block_manager.truncate(state, position)  # type: ignore[arg-type]
            state.num_computed_tokens = position
            state.pending = []
        else:
            keep = position - state.num_computed_tokens
            state.pending = [torch.cat(state.pending)[:keep]] if keep else []
        state.num_features = position

    def finish(self, request_id: str) -> None:
        """Free the request's head K/V and queued features."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.block_manager.free(state)  # type: ignore[arg-type]

    # ---- drafting -------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftInput], k: int) -> Proposal:
        """Draft up to ``k`` tokens per sequence (none for a sequence whose features are incomplete
        or when the head's K/V is full).

        Returns:
            A :class:`Proposal`; ``probs`` (float32 ``[B, k, V]``) when some draft was sampled.
        """
        assert self._target is not None, "attach() the proposer to the target first"
        b_size = len(batch)
        drafts = torch.zeros(b_size, k, dtype=torch.long)
        num_drafts = torch.zeros(b_size, dtype=torch.long)
        rows = [b for b, seq in enumerate(batch) if k > 0 and self._ready(seq, k)]
        if not rows:
            return Proposal(drafts, num_drafts, None)
        states = [self._states[batch[b].request_id] for b in rows]
        params = [batch[b].sampling for b in rows]
        sampled = [self.sample_drafts and not p.greedy for p in params]
        last = self._catch_up([batch[b] for b in rows], states)  # [R, H] output at each last verified position
        probs = torch.zeros(b_size, k, self._target.config.vocab_size) if any(sampled) else None
        for i in range(k):
            tokens = self._draw(last, params, sampled, states, probs, rows, i)  # [R]
            drafts[rows, i] = tokens.cpu()
            if i + 1 < k:
                last = self._step([s.num_computed_tokens + i for s in states], states, tokens, last)
        for state in states:  # drop the K/V of draft positions: real features replace it next step
            self.block_manager.truncate(state, state.num_computed_tokens)  # type: ignore[arg-type]
        num_drafts[rows] = k
        return Proposal(drafts, num_drafts, probs)

    @torch.inference_mode()
    def propose_tree(self, batch: Sequence[DraftInput], shape: TreeShape) -> list[DraftTree]:
        """A draft tree per sequence, EAGLE-2's dynamic tree (Li et al. 2024, arXiv 2406.16858 §4.1):
        the catch-up pass gives the first position's q; each further depth is one batched head pass
        over the ``width`` likeliest nodes of the depth before (by the product of q along their
        path), each attending to the head's K/V and its own ancestors (tree attention); every
        expanded node gets its ``width`` likeliest children; the ``nodes`` likeliest nodes overall
        form the tree (ancestor-closed: a child is never likelier than its parent). A ``sampled``
        shape draws a sampling request's children from q instead (``eagle_tree.py``) and hands q
        to the verifier with the tree (``DraftTree.q``) when the proposer samples its drafts.

        q is processed as the request samples (temperature → top-k → top-p), so no node is a token
        the target could not emit; greedy requests rank by the head's own logits. A sequence whose
        features are incomplete or for which the head's K/V is full gets an empty tree.
        """
        assert self._target is not None, "attach() the proposer to the target first"
        width, depth = shape.width, shape.depth
        trees = [DraftTree([], []) for _ in batch]
        rows = [b for b, seq in enumerate(batch) if self._ready(seq, (depth - 1) * width + 1)]
        if not rows:
            return trees
        states = [self._states[batch[b].request_id] for b in rows]
        params = [batch[b].sampling for b in rows]
        clock = _Stopwatch(self.tree_seconds)
        last = self._catch_up([batch[b] for b in rows], states)  # [R, H]
        clock.lap("catch_up")
        logq = self._draft_logprobs(last, params)  # [R, Vd]
        clock.lap("draft_q")
        samplers = [state.generator if shape.sampled and self.sample_drafts and not p.greedy else None
                    for state, p in zip(states, params, strict=True)]
        search = TreeSearch(logq, last, [s.num_computed_tokens for s in states], width, depth, samplers, shape.nodes)
        for d in range(1, depth):
            level = search.level(d)
            if level is None:
                break
            meta = build_metadata(level.q_lens, level.kv_lens, [states[r].block_table for r in level.live],
                                  self.page_size, level.masks)
            self.backend.plan(meta)
            device = self._head_weight.device
            token_ids = self._d2t[torch.tensor(level.draft_ids)].to(device)
            embeds = F.embedding(token_ids, self._target.model.embed_tokens.weight)
            clock.lap("build")
            out = self.head(embeds, torch.stack(level.features), torch.tensor(level.positions, device=device),
                            self.kv_cache, self.backend, from_target=False)  # [rows, H]
            clock.lap("head_passes")
            logq = self._draft_logprobs(out, [params[r] for r, n in zip(level.live, level.q_lens, strict=True)
                                              for _ in range(n)])
            clock.lap("draft_q")
            search.expand(level, d, out, logq)
        for state in states:  # drop the K/V of the tree rows: real features replace it next step
            self.block_manager.truncate(state, state.num_computed_tokens)  # type: ignore[arg-type]
        d2t = self._d2t.tolist()
        for r, b in enumerate(rows):
            trees[b] = search.tree(r, d2t, shape.nodes, self._d2t)
        clock.lap("build")
        return trees

    def _draft_logprobs(self, hidden: torch.Tensor, params: list) -> torch.Tensor:
        """float32 ``[R, draft_vocab]`` log q of each row, processed as its request samples (greedy
        rows: the head's log-softmax), on the CPU."""
        logits = self.head.draft_logits(hidden, self._head_weight).cpu()
        return processed_logprobs(logits, params)

    def _ready(self, seq: DraftInput, k: int) -> bool:
        """Features known up to the last verified position, something to catch up on, and pages for it."""
        state = self._states.get(seq.request_id)
        if state is None or not state.usable or state.num_features != len(seq.token_ids) - 1:
            return False
        if state.num_features == state.num_computed_tokens:
            return False
        # The head's own K/V for k drafts: each draft after the first is a head step at positions
        # num_features .. num_features + k - 2.
        # Not the engine's draft_cap: the head drafts k and the engine trims to the request's limit.
        return self.block_manager.grow(state, state.num_features + k - 1)  # type: ignore[arg-type]

    def _catch_up(self, batch: list[DraftInput], states: list[DraftState]) -> torch.Tensor:
        assert self._target is not None
        features, tokens, positions, q_lens = [], [], [], []
        for seq, state in zip(batch, states, strict=True):
            start, end = state.num_computed_tokens, state.num_features
            features.extend(state.pending)
            tokens.extend(seq.token_ids[start + 1 : end + 1])  # pair f_t with x_{t+1}
            positions.extend(range(start, end))
            q_lens.append(end - start)
            state.pending, state.num_computed_tokens = [], end
        device = self._head_weight.device
        meta = build_metadata(q_lens, [s.num_computed_tokens for s in states], [s.block_table for s in states],
                              self.page_size)
        self.backend.plan(meta)
        embeds = F.embedding(torch.tensor(tokens, device=device), self._target.model.embed_tokens.weight)
        hidden = self.head(embeds, torch.cat(features), torch.tensor(positions, device=device), self.kv_cache,
                           self.backend, from_target=True)  # [T, H]
        ends = torch.tensor(q_lens, device=device).cumsum(0) - 1
        return hidden[ends]

    def _step(self, positions: list[int], states: list[DraftState], tokens: torch.Tensor,
              last: torch.Tensor) -> torch.Tensor:
        """One more draft position per row, fed with the head's previous output."""
        assert self._target is not None
        meta = build_metadata([1] * len(states), [p + 1 for p in positions], [s.block_table for s in states],
                              self.page_size)
        self.backend.plan(meta)
        embeds = F.embedding(tokens, self._target.model.embed_tokens.weight)
        pos = torch.tensor(positions, device=tokens.device)
        return self.head(embeds, last, pos, self.kv_cache, self.backend, from_target=False)

    def _draw(self, last: torch.Tensor, params: list, sampled: list[bool], states: list[DraftState],
              probs: torch.Tensor | None, rows: list[int], i: int) -> torch.Tensor:
        """Draft token i of each row: sampled from processed q (recorded in ``probs``) or argmax.

        q is processed (temperature → top-k → top-p) over the draft vocabulary alone: every other
        token has q = 0, so its ranks and its mass are those of the full vocabulary's processing."""
        assert self._target is not None
        logits = self.head.draft_logits(last, self._head_weight).cpu()  # [R, draft_vocab], ascending target ids
        drawn = logits.argmax(-1)  # [R] draft ids
        if any(sampled):
            logprobs = processed_logprobs(logits, params)  # [R, draft_vocab]
            for r, (is_sampled, state) in enumerate(zip(sampled, states, strict=True)):
                if is_sampled:
                    q = logprobs[r].double().exp()
                    u = torch.rand(1, dtype=torch.float64, generator=state.generator)
                    drawn[r] = draw_inverse_cdf(q[None], u)[0]
                    probs[rows[r], i, self._d2t] = q.float()  # type: ignore[index]
                else:
                    probs[rows[r], i, self._d2t[drawn[r]]] = 1.0  # type: ignore[index]
        return self._d2t[drawn].to(last.device)


class _Stopwatch:
    """Adds the seconds since the last lap to ``totals[name]`` at each :meth:`lap`."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals, self.last = totals, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.totals[name] += now - self.last
        self.last = now
