"""The ``--keys DIR`` flag of the roles (trainer, generator, drafter trainer) and the check every
role makes of its keys before it opens a socket (``network.security = "curve"``; ``protocol/curve.py``)."""

from __future__ import annotations

import logging
import sys

from specroll.actors.config import RunConfig, toml_value
from specroll.protocol.curve import ClientKeys, KeysError


def keys_overrides(keys_dir: str | None) -> list[str]:
    """The config overrides of ``--keys DIR``: CURVE with the keys in ``DIR``."""
    if keys_dir is None:
        return []
    return ['network.security="curve"', f"network.keys_dir={toml_value(keys_dir)}"]


def keys_usable(config: RunConfig, role: str, prog: str) -> bool:
    """Whether ``role``'s keys load (always, without CURVE); if not, prints the one error line
    naming the key file to stderr."""
    try:
        config.network.curve_keys(config.run_dir, role)
    except KeysError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return False
    return True


def peer_keys(config: RunConfig, role: str, log: logging.Logger) -> ClientKeys | None:
    """A generator's or drafter trainer's CURVE keys (None without CURVE), saying where they came from.

    Raises:
        KeysError: a key file missing, unreadable, exposed or malformed.
    """
    keys = config.network.client_keys(config.run_dir, role)
    if keys is not None:
        log.info("CURVE security: the %s key pair and the trainer's public key from %s", role,
                 config.network.keys_path(config.run_dir))
    return keys
