"""The trainer's command line: ``python -m specroll.actors.trainer --config FILE [--set a.b=v]``;
``specroll trainer`` loads the config itself and calls :func:`serve`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import anyio

from specroll.actors.config import ConfigError, RunConfig, load_config
from specroll.actors.exit_codes import EXIT_REFUSED
from specroll.actors.trainer.process import run_trainer

log = logging.getLogger("specroll.trainer")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specroll.actors.trainer",
                                description="Run the trainer actor: GRPO on rollouts from connected generators.")
    p.add_argument("--config", default=None, help="run config TOML (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set trainer.batch_groups=2 (repeatable)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, load the config, run; return the exit code."""
    args = parse_args(argv)
    _configure_logging(args.log_level)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_REFUSED
    return anyio.run(run_trainer, config, backend="asyncio")


def serve(config: RunConfig, log_level: str = "INFO") -> int:
    """Run the trainer of an already loaded ``config``; return its exit code."""
    _configure_logging(log_level)
    return anyio.run(run_trainer, config, backend="asyncio")


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
