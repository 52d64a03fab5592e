"""Page allocation for the paged KV cache: reference counts and a prefix cache.

A sequence owns a ``block_table``: the ids of the pages holding its K/V, in order. Full pages are
keyed by ``(weight version, key of the previous page, the page's tokens)``, so two requests with
the same prompt (the n samples of a GRPO group, or the same prompt in a later RL step under the
same weights) share them, and K/V computed under older weights is never reused. Pages whose
reference count falls to zero stay keyed and are reused on a hit until they are evicted, oldest
first, to make room (the scheme of vLLM's prefix caching and nano-vllm's block manager). How
often a prompt's K/V comes from the cache is counted in :class:`PrefixCacheCounters`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from specroll.engine.sequence import Sequence

PageKey = tuple[int, int, tuple[int, ...]]
"""(weight version, hash of the previous page's key or 0, this page's token ids)."""


def page_keys(token_ids: SequenceOf[int], num_pages: int, page_size: int, version: int) -> list[PageKey]:
    """Keys of the first ``num_pages`` full pages of ``token_ids``, each chained to the one before."""
    keys: list[PageKey] = []
    parent = 0
    for i in range(num_pages):
        key = (version, parent, tuple(token_ids[i * page_size : (i + 1) * page_size]))
        keys.append(key)
        parent = hash(key)
    return keys


@dataclass
class PrefixCacheCounters:
    """One engine's prefix-cache counters, in tokens, cumulative since the engine was built.

    Each engine request is counted once, when :meth:`BlockManager.allocate` first gives it pages
    (it joins the batch):

    * ``prompt_tokens`` grows by its prompt length as the engine sees it. A sample resumed from
      tokens streamed elsewhere, or re-added after a weight update with ``kv_policy="recompute"``,
      is a new engine request whose prompt holds those response tokens, and counts them as prompt.
    * ``cached_prompt_tokens`` grows by how many of those tokens had their K/V taken from the prefix
      cache instead of computed: whole cached pages, never the prompt's last token (always computed).
      A sibling of a group that takes the pages a member computed a step earlier is a hit.

    Not counted: a request re-admitted after a preemption (it recomputes what it had, the preemption's
    cost, counted by ``Scheduler.num_preemptions``; its prompt was counted at its first admission),
    an admission refused for want of pages, a request aborted before it was admitted. With prefix
    caching off, or a request whose prompt is never shared, every prompt token counts as computed.
    """

    prompt_tokens: int = 0
    """Prompt tokens admitted."""
    cached_prompt_tokens: int = 0
    """Of those, tokens whose K/V came from the prefix cache."""


class BlockManager:
    """Owns ``num_pages`` KV pages of ``page_size`` tokens each.

    Raises:
        ValueError: on construction when ``num_pages`` or ``page_size`` is not positive.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages}, page_size={page_size}: expected positive integers")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        # Free pages in eviction order (least recently freed first); keyed ones still hold K/V.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._key_of_page: dict[int, PageKey] = {}
        self._page_of_key: dict[PageKey, int] = {}
        self.prefix_counters = PrefixCacheCounters()
        """Prompt tokens admitted, and those whose K/V came from the cache (counted in :meth:`allocate`)."""

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _take_free_page(self) -> int:
        page, _ = self._free.popitem(last=False)
        key = self._key_of_page.pop(page, None)
        if key is not None:
            del self._page_of_key[key]
        self.ref_counts[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        assert self.ref_counts[page] >= 0, f"page {page} freed twice"
        if self.ref_counts[page] == 0:
            self._free[page] = None

    def allocate(self, seq: Sequence, version: int) -> bool:
        """Give a waiting ``seq`` pages for all its tokens, reusing cached full pages.

        At least the last token is always left to compute, so the step that admits ``seq``
        produces its next-token logits. Sets ``block_table`` and ``num_computed_tokens``
        (the tokens whose K/V came from the cache), and on a first admission counts the prompt in
        :attr:`prefix_counters`. Returns False, changing nothing, when pages are short.
        """
        assert not seq.block_table, f"request {seq.request_id} already holds pages"
        num_pages = self.pages_needed(seq.num_tokens)
        cached: list[int] = []
        keys: list[PageKey] = []
        if self.enable_prefix_caching and seq.prefix_cacheable:
            max_hit = (seq.num_tokens - 1) // self.page_size
            keys = page_keys(seq.token_ids, max_hit, self.page_size, version)
            for key in keys:
                page = self._page_of_key.get(key)
                if page is None:
                    break
                cached.append(page)
        num_revived = sum(1 for page in cached if self.ref_counts[page] == 0)
        if num_pages - len(cached) > self.num_free_pages - num_revived:
            return False
        for page in cached:
            if self.ref_counts[page] == 0:
                del self._free[page]
            self.ref_counts[page] += 1
        fresh = [self._take_free_page() for _ in range(num_pages - len(cached))]
        seq.block_table = cached + fresh
        seq.num_computed_tokens = len(cached) * self.page_size
        seq.num_keyed_pages = len(cached)
        seq.last_page_hash = hash(keys[len(cached) - 1]) if cached else 0
        if not seq.admitted:  # a re-admission after a preemption is not a new prompt
            seq.admitted = True
            self.prefix_counters.prompt_tokens += seq.prompt_len
            self.prefix_counters.cached_prompt_tokens += min(seq.num_computed_tokens, seq.prompt_len)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq``'s pages hold ``num_tokens`` tokens; False, changing nothing, if short."""
        extra = self.pages_needed(num_tokens) - len(seq.block_table)
        if extra > self.num_free_pages:
            return False
        seq.block_table.extend(self._take_free_page() for _ in range(max(extra, 0)))
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop pages beyond what ``num_tokens`` tokens need (rollback of rejected drafts)."""
        keep = self.pages_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release every page of ``seq`` (finished, aborted or preempted)."""
        for page in reversed(seq.block_table):
            self._release(page)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_keyed_pages = 0
        seq.last_page_hash = 0
        seq.prefix_cacheable = True  # whatever it recomputes uses one weight version

    def forget_cached(self) -> int:
        """Drop every prefix-cache key: pages in use stay with their sequences (their K/V intact, but
        no longer shared with a later request), free pages become plain free pages, and nothing is
        shared until pages are keyed again. Returns how many pages were keyed."""
        forgotten = len(self._key_of_page)
        self._key_of_page.clear()
        self._page_of_key.clear()
        return forgotten

    def cache_full_pages(self, seq: Sequence, version: int) -> None:
        """Key ``seq``'s newly full pages whose K/V is computed, so later requests share them.

        A sequence whose K/V mixes weight versions (``seq.prefix_cacheable`` cleared by a weight
        update) is never keyed.
        """
        if not self.enable_prefix_caching or not seq.prefix_cacheable:
            return
        ps = self.page_size
        for i in range(seq.num_keyed_pages, seq.num_computed_tokens // ps):
            key = (version, seq.last_page_hash, tuple(seq.token_ids[i * ps : (i + 1) * ps]))
            seq.last_page_hash = hash(key)
            seq.num_keyed_pages = i + 1
            page = seq.block_table[i]
            if page in self._key_of_page or key in self._page_of_key:
                continue
            self._key_of_page[page] = key
            self._page_of_key[key] = page
