"""The drafter trainer's command line: ``specroll drafter serve`` and ``python -m specroll.actors.drafter_trainer.cli``
(``--connect`` and a run config, ``--config FILE [--set a.b=v]``; no file: the defaults)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from specroll.actors.config.schema import ConfigError, RunConfig, load_config
from specroll.actors.drafter_trainer.actor import DrafterSettings, run_drafter
from specroll.drafter.learner import LearnerConfig

DRAFTER_DIRNAME = "drafter"
"""Where in the run directory the drafter trainer saves its latest published version."""


def settings_from_config(config: RunConfig, connect: str, actor_id: str = "") -> DrafterSettings:
    """The drafter trainer's settings from a run config: ``[drafter]`` (training, schedule, warm
    start ``path``), ``[model]`` the policy, ``[network]`` the window and trainer timeout; it saves
    every published version to ``RUN_DIR/drafter``.

    Raises:
        ValueError: a value out of range.
    """
    d = config.drafter
    learner = LearnerConfig(lr=d.learning_rate, batch=d.batch, window=d.window_tokens, ttt_steps=d.ttt_steps,
                            hidden_weight=d.hidden_weight,
                            buffer_rollouts=d.window_rollouts, min_rollouts=d.min_rollouts,
                            draft_vocab_size=d.draft_vocab_size, features=d.features, seed=config.seed)
    return DrafterSettings(
        connect=connect, model=config.model.name, actor_id=actor_id, init=d.path, learner=learner,
        publish_every=d.publish_every_steps, num_threads=d.num_threads, duty_cycle=d.duty_cycle,
        train_below=d.train_below, save_dir=str(Path(config.run_dir) / DRAFTER_DIRNAME),
        heartbeat_s=config.generator.heartbeat_s, trainer_timeout_s=config.network.heartbeat_timeout_s,
        window=config.network.window,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--connect``, ``--config``, ``--set``, ``--actor-id``, ``--log-level``."""
    p.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                   help="the trainer's endpoint (RUN_DIR/trainer.endpoint on the trainer's host)")
    p.add_argument("--config", default=None, metavar="FILE", help="run config TOML (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. drafter.duty_cycle=0.3 (repeatable)")
    p.add_argument("--actor-id", default=None, help="unique id (default: drafter-<uuid4 hex>)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the drafter trainer, return its exit code (2: bad input)."""
    p = argparse.ArgumentParser(prog="specroll drafter serve",
                                description="Run the drafter trainer: train the EAGLE drafter online on the "
                                            "trainer's rollouts and publish drafter versions to the generators.")
    add_arguments(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    transport, sep, address = a.connect.partition("://")
    if not sep or transport not in ("tcp", "ipc") or not address:
        print(f"{p.prog}: error: --connect {a.connect!r}: expected tcp://HOST:PORT (or ipc://PATH)", file=sys.stderr)
        return 2
    try:
        settings = settings_from_config(load_config(a.config, a.overrides), a.connect, a.actor_id or "")
    except (ConfigError, ValueError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    from specroll.drafter.eagle_head import DrafterError
    from specroll.engine.checkpoint import CheckpointError

    try:
        return anyio.run(run_drafter, settings, backend="asyncio")
    except (CheckpointError, DrafterError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
