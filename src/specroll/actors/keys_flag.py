"""The ``--keys DIR`` flag of the roles, apart from ``security.py`` so that ``specroll`` builds its
parser without importing the config or ZeroMQ."""

from __future__ import annotations

import argparse


def add_keys_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="the run's CURVE keys ('specroll keys init'; the launcher's RUN_DIR/keys): sets "
                        "network.security = 'curve' and network.keys_dir = DIR")
