"""bfloat16 linear layers on the CPU through oneDNN with weights packed once.

``F.linear`` on a bf16 CPU tensor reaches oneDNN's matmul too, but hands it the plain row-major
weight every call, which oneDNN reorders into its blocked layout before it multiplies: at batch 1 a
layer's matmuls then stream ~7 GB/s where the packed weight streams ~19 (the LM head
``[49152, 576]``: 8.9 ms against 3.0 ms on one core of this project's CPU, docs/benchmarks.md). Packing
each weight once into that layout (``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's freezing
pass does for the weights it folds; vLLM's CPU backend does the same with its own oneDNN handles,
``dispatch_cpu_unquantized_gemm``) and calling ``torch.ops.mkldnn._linear_pointwise`` on it computes the
same products at the packed speed: bit for bit up to 32 rows, within one bf16 rounding above (oneDNN
blocks the sums of larger batches differently).

The packed copy hangs off the parameter itself (attribute :data:`PACKED`), so whoever holds the
parameter — the eager layer, a compiled graph's opaque op (``compiled_step.py``) — finds it without a
registry. It is a copy: a weight changed in place must be packed again (``CausalLM.load_weights``
does it for every weight it copies into); one replaced by a new tensor simply has no packed copy and
takes ``F.linear``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F

PACKED = "_specroll_onednn_packed"
"""The attribute of a weight tensor that holds its oneDNN-packed copy."""


def packing_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights are not packed for this engine (a phrase completing "weights not packed: ..."),
    or None when they are: a CPU, bfloat16 (float32 stays on the reference path, where the parity
    tests run; oneDNN's float32 sums in another order than MKL's) and a torch built with oneDNN's
    packed linear."""
    if device.type != "cpu":
        return f"the engine runs on {device}"
    if dtype != torch.bfloat16:
        return f"the dtype is {str(dtype).removeprefix('torch.')} (packing is for bfloat16)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch has no oneDNN packed linear"
    return _cpu_problem()


@functools.cache
def _cpu_problem() -> str | None:
    """Whether this CPU runs oneDNN's bf16 packed linear: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT
    (an AVX2-only CPU raises at the first pack); tried once on a 1 × 1 weight."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(1, 1, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return "this CPU has no oneDNN bf16 packed linear (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)"
    return None


def pack(weight: torch.Tensor) -> None:
    """Pack ``weight`` ``[out_features, in_features]`` bf16 (again, when it changed in place)."""
    with torch.no_grad():
        setattr(weight, PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))


def pack_all(weights: Iterable[torch.Tensor]) -> int:
    """Pack each weight; returns the bytes the packed copies take (as many as the weights)."""
    total = 0
    for weight in weights:
        pack(weight)
        total += weight.numel() * weight.element_size()
    return total


def repack(weight: torch.Tensor) -> None:
    """Pack ``weight`` again when it has a packed copy (its values changed in place)."""
    if getattr(weight, PACKED, None) is not None:
        pack(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``[..., in]`` → ``[..., out]``): through the packed copy when
    ``weight`` has one, else ``F.linear``."""
    packed = getattr(weight, PACKED, None)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
