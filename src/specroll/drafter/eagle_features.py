"""What the EAGLE proposer keeps between steps: each request's place in the head's K/V with the
target features waiting for it (:class:`DraftState`), and the features of full prompt pages shared
between requests (:class:`PromptFeatureCache`).

When the target takes a request's first pages from its prefix cache (a group's shared prompt, a
common system prompt) it computes no features for them; the cache keeps the features of the full
prompt pages the proposer has seen, keyed by the chain of their tokens as the target's prefix cache
is, and hands them to the requests that skipped those positions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specroll.engine.block_manager import PageKey, page_keys
from specroll.engine.spec.proposer import FeatureUpdate


@dataclass(eq=False)
class DraftState:
    """One request's place in the head's K/V (pages managed by a ``BlockManager``)."""

    request_id: str
    generator: torch.Generator
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Positions whose head K/V was computed from target features."""
    num_features: int = 0
    """Positions whose target features are known: the computed ones and ``pending``."""
    pending: list[torch.Tensor] = field(default_factory=list)
    usable: bool = True
    """False when features of some position never arrived: the request is not drafted."""
    # Fields BlockManager.free resets; the head's pages are never prefix-cached.
    num_keyed_pages: int = 0
    last_page_hash: int = 0
    prefix_cacheable: bool = False


class PromptFeatureCache:
    """Target features of full prompt pages, least recently used evicted first.

    Args:
        page_size: positions per page (should divide the engine's page size, so the chained keys
            of the target's prefix cache hits are found here).
        max_pages: pages kept.
    """

    def __init__(self, page_size: int, max_pages: int) -> None:
        self.page_size, self.max_pages = page_size, max_pages
        self._pages: OrderedDict[PageKey, torch.Tensor] = OrderedDict()  # chained page key → [page_size, F]

    def remember(self, state: DraftState, u: FeatureUpdate) -> None:
        """Keep the features of full prompt pages ``u`` completed for ``state`` (all still pending:
        a request's prompt features arrive before its first draft)."""
        ps = self.page_size
        first, last = u.start // ps, min(state.num_features, u.prompt_len - 1) // ps
        if first >= last or state.num_computed_tokens > first * ps:
            return
        pending = torch.cat(state.pending)  # positions [num_computed_tokens, num_features)
        for i, key in enumerate(page_keys(u.token_ids, last, ps, 0)[first:], start=first):
            rows = slice(i * ps - state.num_computed_tokens, (i + 1) * ps - state.num_computed_tokens)
            self._pages[key] = pending[rows].clone()
            self._pages.move_to_end(key)
        while len(self._pages) > self.max_pages:
            self._pages.popitem(last=False)

    def prefix(self, token_ids: Sequence[int], num_positions: int) -> torch.Tensor | None:
        """Features ``[num_positions, F]`` of positions ``[0, num_positions)``, if every page is here."""
        pages = []
        for key in page_keys(token_ids, -(-num_positions // self.page_size), self.page_size, 0):
            page = self._pages.get(key)
            if page is None:
                return None
            self._pages.move_to_end(key)
            pages.append(page)
        return torch.cat(pages)[:num_positions]
