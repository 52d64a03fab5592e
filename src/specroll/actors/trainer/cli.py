"""The trainer's command line: ``python -m specroll.actors.trainer --config FILE [--set a.b=v]``
(with ``trainer.world_size`` > 1 also ``--rank R --world-size N --master ADDR:PORT``, or under
``torchrun``: ``ranks/join.py``); ``specroll trainer`` loads the config itself and calls :func:`serve`.

Rank 0 runs the trainer (``process.py``), every other rank follows it (``ranks/follower.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import anyio

from specroll.actors.config import ConfigError, RunConfig, load_config
from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_REFUSED
from specroll.actors.shared.keys_flag import add_keys_argument
from specroll.actors.shared.security import keys_overrides, keys_usable
from specroll.actors.trainer.process import run_trainer
from specroll.actors.trainer.ranks.flags import add_rank_arguments
from specroll.actors.trainer.ranks.follower import run_follower
from specroll.actors.trainer.ranks.join import RankError, Ranks, join_group, rank_device, resolve_ranks

log = logging.getLogger("specroll.trainer")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specroll.actors.trainer",
                                description="Run the trainer actor: GRPO on rollouts from connected generators.")
    p.add_argument("--config", default=None, help="run config TOML (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set trainer.batch_groups=2 (repeatable)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_rank_arguments(p)
    add_keys_argument(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, load the config, find this rank, run; return the exit code."""
    args = parse_args(argv)
    _configure_logging(args.log_level)
    try:
        config = load_config(args.config, [*args.overrides, *keys_overrides(args.keys)])
        ranks = resolve_ranks(args.rank, args.world_size, args.master, args.local_rank, os.environ,
                              config.trainer.world_size)
    except (ConfigError, RankError) as e:
        log.error("%s", e)
        return EXIT_REFUSED
    return _run(config, ranks)


def serve(config: RunConfig, log_level: str = "INFO", args: argparse.Namespace | None = None) -> int:
    """Run the trainer of an already loaded ``config``, its rank from ``args``' rank flags
    (:func:`add_rank_arguments`) or else torchrun's environment, if any; return its exit code."""
    _configure_logging(log_level)
    flags = [getattr(args, k, None) for k in ("rank", "world_size", "master", "local_rank")]
    try:
        ranks = resolve_ranks(*flags, os.environ, config.trainer.world_size)
    except RankError as e:
        log.error("%s", e)
        return EXIT_REFUSED
    return _run(config, ranks)


def _run(config: RunConfig, ranks: Ranks | None) -> int:
    if ranks is not None and ranks.rank > 0:
        return run_follower(config, ranks)
    if not keys_usable(config, "trainer", "specroll trainer"):
        return EXIT_REFUSED
    store = None
    if ranks is not None:
        # Rank 0 meets the other ranks before anything else, in the main thread and with the default
        # signal dispositions: a SIGTERM or SIGINT while it waits ends it at once (the rendezvous is a
        # blocking call that a worker thread could not be cancelled out of for up to GROUP_TIMEOUT).
        log.info("trainer rank 0 of %d (%s): waiting for the other ranks at %s", ranks.world_size, ranks.source,
                 ranks.init_method)
        try:
            store = join_group(ranks, rank_device(ranks, config.trainer.device))
        except RankError as e:  # trainer.device = "cuda" without a device for this rank
            log.error("%s", e)
            return EXIT_REFUSED
        except (OSError, RuntimeError) as e:  # the port is taken, the rendezvous failed or timed out
            log.error("trainer rank 0: the rendezvous at %s failed: %s", ranks.init_method, e)
            return EXIT_FAILED
    return anyio.run(run_trainer, config, ranks, store, backend="asyncio")


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpx2", "openai"):  # a line per episode turn at INFO: the environments' client
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
