"""A run config whose drafter warm start is sized for a tiny target (a few rollouts of a few tokens,
a fraction of a CPU-second of training), and a snapshot of a cache folder's files."""

from __future__ import annotations

import os
from pathlib import Path

from specroll.actors.config import RunConfig, load_config

BUDGET_MINUTES = 0.005
"""0.3 CPU-seconds of training: a few steps on the tiny target."""
TINY_WARM_START = [
    "drafter.enabled=true", "drafter.draft_vocab_size=64", "drafter.window_tokens=16", "drafter.batch=2",
    f"drafter.warm_start_minutes={BUDGET_MINUTES}", "drafter.warm_start_rollouts=4", "generator.sampling.max_tokens=6",
    "generator.speculative=\"auto\"", "generator.engine.kv_cache_memory_gb=0.02", "generator.engine.dtype=\"float32\"",
]
"""``--set`` items of a warm start for the tiny target (its vocabulary is 320 tokens)."""


def warm_start_config(model: Path, run_dir: Path, cache: Path, *extra: str) -> RunConfig:
    """A run on ``model`` with the drafter trainer on and :data:`TINY_WARM_START`, caching in ``cache``;
    ``extra``: more ``--set`` items."""
    return load_config(None, [f"model.name=\"{model}\"", f"run_dir=\"{run_dir}\"",
                              f"drafter.warm_start_cache_dir=\"{cache}\"", *TINY_WARM_START, *extra])


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: its bytes and modification time (ns)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), os.stat(p).st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}
