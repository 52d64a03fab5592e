"""A blocking :class:`~specroll.actors.rollout.client.RolloutClient` for code without an event loop: the
client runs in a background thread (an anyio blocking portal) and each call waits for its result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from anyio.from_thread import start_blocking_portal

from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.prefix_cache import RESET_TIMEOUT_S, PrefixCacheStats
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import Group
from specroll.rl.group_retries import DroppedGroup


class SyncRolloutClient:
    """:class:`RolloutClient` for code without an event loop: it runs in a background thread.

    Takes the same arguments; use it as a context manager or call :meth:`close`.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", **kwargs: Any) -> None:
        self._portal_cm = start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        self.client = RolloutClient(bind, **kwargs)
        # The client's task group must be entered and left by one task: the portal runs both there.
        self._client_cm = self._portal.wrap_async_context_manager(self.client)
        try:
            self._client_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self.endpoint = self.client.endpoint

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._portal_cm is not None:
            self._client_cm.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None  # type: ignore[assignment]

    def submit(self, prompt_token_ids: list[int], n: int, sampling: SamplingParams, payload: object = None) -> str:
        """See :meth:`RolloutClient.submit`."""
        return self._portal.call(self.client.submit, prompt_token_ids, n, sampling, payload)

    def next_finished(self, timeout: float | None = None) -> Group:
        """See :meth:`RolloutClient.next_finished` (raises ``GroupDropped`` for a dropped group)."""
        return self._portal.call(self.client.next_finished, timeout)

    def publish_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int, dtype: str = "bfloat16") -> None:
        """See :meth:`RolloutClient.publish_weights`."""
        self._portal.call(self.client.publish_weights, named_tensors, version, dtype)

    def pop_finished(self, limit: int | None = None) -> list[Group]:
        """See :meth:`RolloutClient.pop_finished`."""
        return self._portal.call(self.client.pop_finished, limit)

    def pop_dropped(self, limit: int | None = None) -> list[DroppedGroup]:
        """See :meth:`RolloutClient.pop_dropped`."""
        return self._portal.call(self.client.pop_dropped, limit)

    @property
    def num_finished(self) -> int:
        return self.client.num_finished

    def abort(self, group_id: str) -> None:
        """See :meth:`RolloutClient.abort`."""
        self._portal.call(self.client.abort, group_id)

    def wait_for_generators(self, count: int, timeout: float | None = None) -> None:
        """See :meth:`RolloutClient.wait_for_generators`."""
        self._portal.call(self.client.wait_for_generators, count, timeout)

    def wait_for_version(self, version: int, count: int | None = None, timeout: float | None = None) -> None:
        """See :meth:`RolloutClient.wait_for_version`."""
        self._portal.call(self.client.wait_for_version, version, count, timeout)

    def prefix_cache_stats(self) -> dict[str, PrefixCacheStats]:
        """See :meth:`RolloutClient.prefix_cache_stats`."""
        return self._portal.call(self.client.prefix_cache_stats)

    def reset_prefix_cache(self, timeout: float = RESET_TIMEOUT_S) -> int:
        """See :meth:`RolloutClient.reset_prefix_cache`."""
        return self._portal.call(self.client.reset_prefix_cache, timeout)
