"""argparse value types whose errors name the bad value, for every command's parser."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a positive integer, with a message naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def positive_float(text: str) -> float:
    """argparse type: a positive finite number, with a message naming the bad value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value
