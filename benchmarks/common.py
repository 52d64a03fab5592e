"""Set-up shared by the benchmark scripts (imported as ``common`` from ``benchmarks/``)."""

from __future__ import annotations

import os

import torch


def setup_torch(threads: int | None, dtype_name: str) -> tuple[torch.dtype, str, int, float]:
    """Apply ``--threads`` and resolve ``--dtype`` as the engine does.

    Returns:
        ``(dtype, its name, torch threads in use, 1-minute load average now)``: another busy process
        on a 2-core machine skews every figure, and the load average shows it.
    """
    from specroll.engine.engine import resolve_dtype

    if threads is not None:
        torch.set_num_threads(threads)
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    return dtype, str(dtype).removeprefix("torch."), torch.get_num_threads(), os.getloadavg()[0]
