"""The one engine builder of the engine, drafter and speculation tests (a small engine on a tiny
checkpoint), a stand-in for the parts of the proposer protocol a tree proposer needs, and the
step-path tests' prompts, drafter and run (graph steps, compiled steps against eager ones)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specroll.drafter.suffix import SuffixProposer
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.spec.proposer import Proposal, Proposer
from specroll.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from specroll.engine.loaders.checkpoint import Checkpoint

PAGE = 8
"""Tokens per KV page of :func:`make_engine`'s engines."""
TINY_ENGINE: dict[str, object] = dict(page_size=PAGE, kv_cache_memory_gb=0.01, max_model_len=256, dtype="float32")
"""What :func:`make_engine` sets unless told otherwise: float32, 8-token pages, 10 MB of KV cache, 256 positions."""
TREE_SPECULATION: dict[str, object] = dict(num_draft_tokens=4, draft_length="tree", draft_trees=("5x2:10",))
"""The tree speculation tests' settings: draft trees of depth 5 and width 2, at most 10 nodes."""


def make_engine(path: Path | str, proposer: Proposer | None = None, checkpoint: Checkpoint | None = None,
                **settings: object) -> Engine:
    """An :class:`Engine` on the checkpoint at ``path`` with :data:`TINY_ENGINE`, overridden by
    ``settings`` (``EngineConfig`` fields); ``proposer`` drafts for it (``None``: plain decoding) and
    ``checkpoint``, when given, is served instead of loading ``path``'s weights."""
    config = EngineConfig(**{"model": str(path), **TINY_ENGINE, **settings})  # type: ignore[arg-type]
    return Engine(config, checkpoint, proposer=proposer)


class StandIn:
    """The parts of the proposer protocol a tree proposer needs and nothing more."""

    feature_layers: tuple[int, ...] = ()

    def attach(self, target) -> None:
        pass

    def propose(self, batch, k):
        return Proposal(torch.zeros(len(batch), k, dtype=torch.long), torch.zeros(len(batch), dtype=torch.long), None)

    def observe(self, updates) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass


K = 4
"""Drafts per verify of :class:`KDrafts`."""


class KDrafts(SuffixProposer):
    """Suffix matching, every row topped up to k drafts with its last draft (or token): each verify
    step is uniform, so it replays the k + 1 graph, and drafts are accepted now and then."""

    def propose(self, batch, k):
        proposal = super().propose(batch, k)
        ids = proposal.token_ids.clone()
        for row, n, seq in zip(ids, proposal.num_drafts.tolist(), batch, strict=True):
            row[n:] = int(row[n - 1]) if n else seq.token_ids[-1]
        return type(proposal)(ids, torch.full_like(proposal.num_drafts, k), None)


def k_drafts(speculative: bool) -> KDrafts | None:
    return KDrafts(min_ngram=1, max_ngram=4) if speculative else None


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of repeated motifs (so suffix matching drafts), of lengths around page boundaries."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(3, 300, (3 + i % 3,), generator=g).tolist()
        length = PAGE * (1 + i % 3) - i % 4
        out.append((motif * (length // len(motif) + 1))[:length])
    return out


def run(engine: Engine, prompts: list[list[int]], temperature: float) -> dict[str, tuple[list[int], list[float]]]:
    """Each prompt with its own seed and length (so the live batch shrinks step by step), to completion:
    request id → (tokens, logprobs)."""
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=temperature, max_tokens=6 + 3 * i, ignore_eos=True, seed=100 + i)
        engine.add_request(prompt, sampling, f"r{i}")
    return {r: (c.token_ids, c.logprobs) for r, c in run_to_completion(engine).items()}
