"""The server process's command line: ``python -m specroll.actors.server --config FILE [--set a.b=v]``
(what ``specroll serve`` runs in the trainer's place; ``process.py``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import anyio

from specroll.actors.config import ConfigError, load_config
from specroll.actors.server.process import run_server
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.actors.shared.keys_flag import add_keys_argument
from specroll.actors.shared.security import keys_overrides

log = logging.getLogger("specroll.server")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, load the config, serve; return the exit code."""
    p = argparse.ArgumentParser(prog="python -m specroll.actors.server",
                                description="Run the OpenAI-compatible server and the hub its generators connect to.")
    p.add_argument("--config", default=None, help="run config TOML (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set server.port=8001 (repeatable)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_keys_argument(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, [*args.overrides, *keys_overrides(args.keys)])
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_REFUSED
    return anyio.run(run_server, config)
