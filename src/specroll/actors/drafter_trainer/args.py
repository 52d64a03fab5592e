"""The drafter trainer's command-line arguments, apart from its entry point so that ``specroll``
builds its parser (``specroll drafter serve``) without importing torch."""

from __future__ import annotations

import argparse

from specroll.actors.shared.keys_flag import add_keys_argument

PROG = "specroll drafter serve"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--connect``, ``--config``, ``--set``, ``--actor-id``, ``--log-level``, ``--keys``."""
    p.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                   help="the trainer's endpoint (RUN_DIR/trainer.endpoint on the trainer's host)")
    p.add_argument("--config", default=None, metavar="FILE", help="run config TOML (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. drafter.duty_cycle=0.3 (repeatable)")
    p.add_argument("--actor-id", default=None, help="unique id (default: drafter-<uuid4 hex>)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_keys_argument(p)
