"""The ``--keys DIR`` flag of the roles, apart from ``security.py`` so that ``specroll`` builds its
parser without importing the config or ZeroMQ."""

from __future__ import annotations

import argparse


def keys_dir(text: str) -> str:
    """``--keys``'s value: a path that is not empty or blank (argparse reports the error, exit 2)."""
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected the directory of the run's keys")
    return text


def add_keys_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", default=None, metavar="DIR", type=keys_dir,
                   help="the run's CURVE keys ('specroll keys init'; the launcher's RUN_DIR/keys): sets "
                        "network.security = 'curve' and network.keys_dir = DIR")
