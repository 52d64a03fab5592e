"""EAGLE heads for a tiny target, and a run config with the drafter trainer on."""

from __future__ import annotations

from pathlib import Path

import torch

from specroll.actors.config import DrafterConfig, ModelSection, RunConfig, write_resolved
from specroll.drafter.eagle_config import EagleConfig, build_draft_vocab, eagle3_feature_layers
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.model_config import ModelConfig


def make_head(config: ModelConfig, taps: str = "last", draft_vocab: int = 200, seed: int = 0,
              architecture: str = "eagle3") -> EagleHead:
    """A random EAGLE head for the target ``config``: features from its last layer (``taps="last"``)
    or EAGLE-3's low/mid/high layers (``"eagle3"``), a draft vocabulary of the ``draft_vocab`` lowest ids."""
    layers = (config.num_layers,) if taps == "last" else eagle3_feature_layers(config.num_layers)
    counts = torch.arange(config.vocab_size, 0, -1).float()  # low ids most frequent
    return EagleHead.init(EagleConfig.for_target(config, layers, draft_vocab, architecture),
                          build_draft_vocab(counts, draft_vocab), seed=seed)


def run_config(model: Path, run_dir: Path) -> Path:
    """A run on ``model`` whose drafter trainer publishes early and often (4 rollouts, every 3 steps),
    written resolved to ``run_dir/config.toml``; its path."""
    drafter = DrafterConfig(enabled=True, min_rollouts=4, publish_every_steps=3, batch=4, window_tokens=32,
                            draft_vocab_size=128, duty_cycle=1.0, num_threads=1)
    config = RunConfig(run_dir=str(run_dir), model=ModelSection(name=str(model)), drafter=drafter)
    return write_resolved(config)
