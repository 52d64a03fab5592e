"""The one engine builder of the engine, drafter and speculation tests (a small engine on a tiny
checkpoint), and a stand-in for the parts of the proposer protocol a tree proposer needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specroll.engine.config import EngineConfig
from specroll.engine.engine import Engine
from specroll.engine.spec.proposer import Proposal, Proposer

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
