"""The step's decoder layers compiled with ``torch.compile`` (Inductor), cached on disk.

A CPU decode step of a small model pays more for its ~20 torch calls per layer — each a dispatch, an
allocation and a pass over memory — than for their arithmetic. Inductor fuses the small ones (RMSNorm,
RoPE, SiLU-and-mul, the residual adds) into a few C++ loops per layer. Two choices keep it cheap:

- **The layer stack as one graph** (``paged_forward.paged_layers``): the weights are the graph's inputs,
  not constants, so an in-place weight update shows at the next step (never a stale capture). Compiling
  one layer and calling it per layer (PyTorch's "regional compilation") compiles 3x faster but a compiled
  call costs ~250 us of guards and wrapper on a CPU, 30 of them a step: at batch 1 it was no faster than
  eager (44 ms a step either way; the whole stack: 36 ms). The embedding, the final norm and the LM head
  stay eager: three calls a step.
- **Opaque attention and matmuls.** Attention and the matmuls are custom ops
  (``specroll::paged_attention``, ``specroll::linear``) that Inductor calls as they are and does not
  trace — vLLM's split ("piecewise" compilation around its attention op). Attention reads this step's
  plan from the backend its KV cache names (:data:`ATTENTION`, set by the model runner), so the graph
  has no plan inside it and one graph serves every step kind: decode, verify, prefill chunks and mixed
  batches; the matmuls reach the packed oneDNN weights (``cpu_linear.py``). The cache is a mutated
  input of the attention op, which Inductor re-inplaces: the op writes the real cache, never a copy.

**Shapes.** The token count ``T`` is the only size that changes. The first call with ``T > 1`` marks it
dynamic, so that graph takes any ``T`` (Inductor's CPU loops take it as a bound), and Dynamo always
specialises a size of 1: a run compiles two graphs — ``T = 1`` (batch-1 decode) and any other ``T`` —
where CUDA graphs need one per batch-size bucket (``step_graphs.py``, whose buckets the CUDA path keeps).

**Disk cache.** Inductor's FX-graph cache and AOTAutograd cache write the compiled code under
``cache_dir``; a later process that traces the same graph loads it instead of compiling
(:class:`CompileCounters` counts both).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specroll.engine import cpu_linear
from specroll.engine.batch import AttentionMetadata
from specroll.engine.paged_forward import LayerWeights, Linear, paged_layers

log = logging.getLogger(__name__)

ATTENTION = "_specroll_attention"
"""The attribute of a KV-cache tensor that names the attention backend planned for its engine's step."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/specroll/compile`` (``~/.cache/specroll/compile`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specroll" / "compile"


_LIBRARY = torch.library.Library("specroll", "DEF")  # kept alive: the ops live as long as it does
# Registered with the low-level API: a call costs ~3 us where ``torch.library.custom_op``'s wrapper costs ~14
# (30 layers x 5 calls a step). ``Tensor(a!)``: the op writes the cache in place (Inductor keeps it in place).
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache) -> Tensor")
_LIBRARY.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """``specroll::paged_attention``: ``AttentionBackend.forward`` of the backend ``kv_cache`` names
    (:data:`ATTENTION`): appends ``k``/``v`` ``[T, H_kv, D]`` to ``kv_cache`` and returns the attention of
    ``q`` ``[T, H, D]``, ``[T, H, D]`` in ``q``'s dtype, contiguous (what the compiled graph was traced for)."""
    return getattr(kv_cache, ATTENTION).forward(q, k, v, kv_cache).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``specroll::linear``: ``cpu_linear.linear``, ``[..., in]`` → ``[..., out]`` through ``weight``'s packed copy."""
    return cpu_linear.linear(x, weight, bias)


_LIBRARY.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("linear", linear, "CompositeExplicitAutograd")


@torch.library.register_fake("specroll::paged_attention")
def _paged_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.register_fake("specroll::linear")
def _linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class _CacheAttention:
    """The attention a compiled layer calls: the opaque op, which finds the planned backend on the cache."""

    def plan(self, meta: AttentionMetadata, graph: tuple[int, int] | None = None) -> None:
        raise AssertionError("the compiled layer's attention is planned through its KV cache's backend")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return torch.ops.specroll.paged_attention(q, k, v, kv_cache)


_CACHE_ATTENTION = _CacheAttention()


def _opaque_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.specroll.linear(x, weight, bias)


def _layers(x: torch.Tensor, weights: Sequence[LayerWeights], cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: Sequence[torch.Tensor], tap_layers: tuple[int, ...], linear: Linear,
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    return paged_layers(x, weights, cos, sin, kv_caches, _CACHE_ATTENTION, tap_layers, linear)


class CompileCacheError(ValueError):
    """``compile_cache_dir`` is not a folder the engine can write compiled code to."""


def usable_cache_dir(configured: str | None) -> Path:
    """The compile cache folder of ``compile_cache_dir`` (None: :func:`default_cache_dir`), created
    if missing and checked writable — before any model is loaded.

    Raises:
        CompileCacheError: it is not a directory the engine can create and write, naming it and why.
    """
    path = Path(configured).expanduser() if configured else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompileCacheError(f"compile_cache_dir={str(path)!r} cannot be created ({e.strerror or e}); "
                         "expected a directory the engine can create and write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CompileCacheError(f"compile_cache_dir={str(path)!r} is not writable; expected a directory the engine "
                         "can write compiled code to")
    return path


@dataclass
class CompileCounters:
    """What compiling has done in this process so far (Dynamo's and Inductor's counters)."""

    graphs: int
    """Graphs Dynamo handed to Inductor (a cached one counts too: it is traced, then loaded)."""
    cache_hits: int
    """Graphs loaded from the FX-graph cache on disk."""
    cache_misses: int
    """Graphs compiled because the cache had none."""

    @staticmethod
    def read() -> CompileCounters:
        from torch._dynamo.utils import counters

        return CompileCounters(graphs=int(counters["stats"]["unique_graphs"]),
                               cache_hits=int(counters["inductor"]["fxgraph_cache_hit"]),
                               cache_misses=int(counters["inductor"]["fxgraph_cache_miss"]))


class CompiledLayers:
    """``paged_layers`` compiled (module docstring): call it as ``paged_layers`` (``CausalLM.forward``'s
    ``layers``). The attention ``backend`` argument is not used: each KV cache must name its planned
    backend (:data:`ATTENTION`), which the model runner sets when it allocates the caches.

    Args:
        cache_dir: where Inductor keeps its compiled code (:func:`usable_cache_dir`); a second process
            with the same directory, torch and model shapes loads it instead of compiling. Inductor
            reads it from the process's ``TORCHINDUCTOR_CACHE_DIR``, which this sets: the last engine
            built in a process names the folder every compile of the process uses.
        opaque_matmuls: run the matmuls through the ``specroll::linear`` op (weights packed for
            oneDNN, ``cpu_linear.py``); False lets Inductor emit them (a float32 or CUDA engine).

    """

    def __init__(self, cache_dir: Path, opaque_matmuls: bool) -> None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # read by Inductor at each cache lookup
        self.cache_dir = cache_dir
        linear = _opaque_linear if opaque_matmuls else torch.nn.functional.linear
        self._compiled = torch.compile(functools.partial(_layers, linear=linear), fullgraph=True)
        self.compile_seconds = 0.0
        """Wall time of the calls that compiled (or loaded) a graph, in seconds."""
        self._seen: set[tuple[int, tuple[int, ...]]] = set()  # (T = 1 or more, taps): each compiles once

    def __call__(self, x: torch.Tensor, weights: Sequence[LayerWeights], cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: Sequence[torch.Tensor], backend: object = None, tap_layers: tuple[int, ...] = (),
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        kind = (min(x.shape[0], 2), tap_layers)
        if kind in self._seen:
            return self._compiled(x, weights, cos, sin, kv_caches, tap_layers)
        if kind[0] == 2:  # compile this one for any T (a size of 1 is always specialised: the other graph)
            for t in (x, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
        before, start = CompileCounters.read(), time.perf_counter()
        out = self._compiled(x, weights, cos, sin, kv_caches, tap_layers)
        spent = time.perf_counter() - start
        self._seen.add(kind)
        self.compile_seconds += spent
        after = CompileCounters.read()
        log.info("compiled the decoder for %s%s in %.1f s (%d graph(s): %d loaded from %s, %d compiled)",
                 "T = 1" if kind[0] == 1 else "any T > 1", f", taps {tap_layers}" if tap_layers else "", spent,
                 after.graphs - before.graphs, after.cache_hits - before.cache_hits, self.cache_dir,
                 after.cache_misses - before.cache_misses)
        return out
