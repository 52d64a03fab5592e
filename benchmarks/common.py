"""Set-up shared by the benchmark scripts (imported as ``common`` from ``benchmarks/``; torch is
imported only when used, so the scripts parse their arguments first)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
"""GSM8K test split in the ``shared/`` folder next to the repository."""


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers such as ``1,4,16``."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers such as 1,4,16") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def setup_torch(threads: int | None, dtype_name: str) -> tuple[torch.dtype, str, int, float]:
    """Apply ``--threads`` and resolve ``--dtype`` as the engine does.

    Returns:
        ``(dtype, its name, torch threads in use, 1-minute load average now)``: another busy process
        on a 2-core machine skews every figure, and the load average shows it.
    """
    import torch

    from specroll.engine.device import resolve_dtype

    if threads is not None:
        torch.set_num_threads(threads)
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    return dtype, str(dtype).removeprefix("torch."), torch.get_num_threads(), os.getloadavg()[0]
