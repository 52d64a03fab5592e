"""The trainer's endpoint as given on a peer's command line (``--connect``)."""

from __future__ import annotations

import argparse


def check_endpoint(text: str) -> str:
    """``text`` when it is a ZeroMQ endpoint to connect to (``tcp://HOST:PORT`` or ``ipc://PATH``).

    Raises:
        ValueError: naming the bad value and what was expected.
    """
    transport, sep, address = text.partition("://")
    if not sep or transport not in ("tcp", "ipc") or not address:
        raise ValueError(f"{text!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    return text


def endpoint_arg(text: str) -> str:
    """argparse type of ``--connect`` (:func:`check_endpoint`)."""
    try:
        return check_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
