"""Where and in what precision the engine runs: the configured torch device, checked against this
machine, and the dtype a config's ``dtype`` name (``auto`` included) stands for there.
"""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype ``name`` stands for; ``auto`` is bfloat16 on CUDA GPUs that support it (float16 on
    older ones) and on CPUs with native bf16 (AVX512-BF16 or AMX: bf16 matmuls there run about twice
    as fast as float32), else float32.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if _cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def training_precision(name: str, device: torch.device) -> str:
    """The training step's arithmetic ``name`` (``trainer.precision``) stands for on ``device``:
    ``auto`` is ``bf16`` where bf16 is native (CUDA GPUs that support it; CPUs with AVX512-BF16 or
    AMX) and ``fp32`` elsewhere — on a CPU without them torch emulates bf16 matmuls, about 35x slower
    than float32 on an AVX2 EPYC (0.72 s against 0.021 s for a 1024² matmul); ``fp32`` and ``bf16``
    stand for themselves.

    Raises:
        ValueError: ``name`` is none of ``auto``, ``fp32``, ``bf16``.
    """
    if name in ("fp32", "bf16"):
        return name
    if name != "auto":
        raise ValueError(f"precision {name!r}, expected 'auto', 'fp32' or 'bf16'")
    return "bf16" if resolve_dtype("auto", device) == torch.bfloat16 else "fp32"  # an engine's float16: fp32


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_device(name: str) -> torch.device:
    """The torch device ``name`` names, usable on this machine.

    Raises:
        ValueError: not a torch device, a CUDA device without CUDA (or an index past the last GPU),
            or a device type other than ``cpu`` and ``cuda``.
    """
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a torch device; expected e.g. 'cpu' or 'cuda:0'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch build or machine has no CUDA; use 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: expected 'cpu' or a CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"expected an index below that")
    return device
