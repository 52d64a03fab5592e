"""What every run-config section shares: a strict frozen struct base and the range checks its
``__post_init__`` uses (each raises ``ValueError`` naming the field, the value and what was expected)."""

from __future__ import annotations

import ipaddress
import typing
from typing import Literal

import msgspec


def require(ok: bool, name: str, value: object, expected: str) -> None:
    """Raise ``ValueError("name=value, expected ...")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r}, expected {expected}")


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
