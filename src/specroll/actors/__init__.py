"""The I/O shell: one package per owner (``rollout`` the hub every trainer drives, ``trainer`` the
built-in GRPO trainer, ``generator``, ``drafter_trainer``, ``peer`` for what both peers share,
``launch``, ``config``, ``jobs`` for the offline CLI jobs) and the
``specroll`` command (``cli.py``).

This module is also the embedding API for another RL stack: the rollout client, the run config and
the built-in tasks, importable as ``from specroll.actors import RolloutClient, SyncRolloutClient,
GroupDropped, QueueFull, load_config, builtin_prompts, ...``. Names are resolved on first use (PEP
562), so importing a role or the CLI never pays for what it does not use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specroll.lazy import lazy_exports

if TYPE_CHECKING:
    from specroll.actors.config import ConfigError, RunConfig, load_config
    from specroll.actors.rollout.client import RolloutClient
    from specroll.actors.rollout.prefix_cache import PrefixCacheStats
    from specroll.actors.rollout.sync_client import SyncRolloutClient
    from specroll.rl.coordinator import Group, QueueFull, Sample
    from specroll.rl.group_retries import DroppedGroup, GroupDropped
    from specroll.rl.tasks import Prompt, builtin_prompts, format_question, gsm8k_reward, load_prompts

_EXPORTS = {
    "RolloutClient": "specroll.actors.rollout.client",
    "PrefixCacheStats": "specroll.actors.rollout.prefix_cache",
    "SyncRolloutClient": "specroll.actors.rollout.sync_client",
    "RunConfig": "specroll.actors.config",
    "ConfigError": "specroll.actors.config",
    "load_config": "specroll.actors.config",
    "Group": "specroll.rl.coordinator",
    "Sample": "specroll.rl.coordinator",
    "QueueFull": "specroll.rl.coordinator",
    "DroppedGroup": "specroll.rl.group_retries",
    "GroupDropped": "specroll.rl.group_retries",
    "Prompt": "specroll.rl.tasks",
    "builtin_prompts": "specroll.rl.tasks",
    "format_question": "specroll.rl.tasks",
    "gsm8k_reward": "specroll.rl.tasks",
    "load_prompts": "specroll.rl.tasks",
}
__all__ = [
    "ConfigError",
    "DroppedGroup",
    "Group",
    "GroupDropped",
    "PrefixCacheStats",
    "Prompt",
    "QueueFull",
    "RolloutClient",
    "RunConfig",
    "Sample",
    "SyncRolloutClient",
    "builtin_prompts",
    "format_question",
    "gsm8k_reward",
    "load_config",
    "load_prompts",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
