"""What every run-config section shares: a strict frozen struct base and the range checks its
``__post_init__`` uses (each raises ``ValueError`` naming the field, the value and what was expected)."""

from __future__ import annotations

import ipaddress
import math
import typing
from typing import Literal

import msgspec


def require(ok: bool, name: str, value: object, expected: str) -> None:
    """Raise ``ValueError("name=value, expected ...")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r}, expected {expected}")


MAX_COUNT = 1 << 20
"""The default upper bound of a count in the config (prompts, groups, requests, messages queued):
far above any run's need, low enough that no setting asks an actor for unbounded work or memory."""
MAX_SECONDS = 7 * 86400.0
"""The longest duration a ``*_s`` setting may ask for (a week): beyond it a timeout is no bound."""


def require_count(name: str, value: int, low: int = 1, high: int = MAX_COUNT) -> None:
    """Raise ``ValueError("name=value, expected an integer in [low, high]")`` unless ``low <= value <= high``."""
    require(low <= value <= high, name, value, f"an integer in [{low}, {high}]")


def require_seconds(name: str, value: float, high: float = MAX_SECONDS, zero: bool = False) -> None:
    """Raise ``ValueError`` naming the value unless it is a finite number of seconds in ``(0, high]``
    (``[0, high]`` with ``zero``)."""
    low_ok = value >= 0 if zero else value > 0
    require(low_ok and math.isfinite(value) and value <= high, name, value,
            f"a number of seconds in {'[' if zero else '('}0, {high:g}]")


def check_literals(struct: msgspec.Struct) -> None:
    """Literal fields hold an allowed value (msgspec checks this when decoding, not when built in code)."""
    for name, kind in typing.get_type_hints(type(struct)).items():
        if typing.get_origin(kind) is Literal:
            allowed = typing.get_args(kind)
            value = getattr(struct, name)
            require(value in allowed, name, value, f"one of {', '.join(map(repr, allowed))}")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``, ``[::1]``); a
    hostname or ``0.0.0.0`` is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: frozen, strict, keyword-only."""
