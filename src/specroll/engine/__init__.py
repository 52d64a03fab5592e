"""The synchronous inference core: model, paged KV cache, scheduler, sampler, speculative decoding.

No sockets, no threads, no event loop. The embedding API is importable from here —
``from specroll.engine import Engine, EngineConfig, SamplingParams`` — resolved on first use
(PEP 562), so importing one engine module (``specroll.engine.config``, say) loads only what it needs.

Which file holds what:

- ``engine.py``: :class:`Engine` — requests in, one step at a time (schedule → propose → run →
  verify/sample → emit), aborts, weight updates; ``driver.py`` runs it to completion.
- ``config.py``: :class:`EngineConfig`; ``device.py`` the device checked and the dtype ``auto``
  resolves to; ``phases.py`` per-phase step timing.
- ``scheduler.py`` (continuous batching under a token budget, preemption), ``block_manager.py``
  (reference-counted pages, the prefix cache keyed by weight version), ``sequence.py`` (a
  request's state; :class:`StepOutput` and :class:`Completion`, what a step and a request report).
- ``model_runner.py``: the target on its device, one forward per step; ``step_graphs.py`` those
  steps as CUDA graphs; ``batch.py`` FlashInfer's batch description every backend reads.
- ``model.py`` (Llama / Qwen2 / Qwen3), ``model_config.py`` (its architecture and weight shapes),
  ``paged_forward.py`` (the inference layer over the paged KV cache), ``rope.py``.
- ``attention.py`` (the backend interface, the KV cache, backend choice), ``torch_attention.py``
  (the reference), ``flashinfer_attention.py`` and ``flashinfer_sampling.py`` (CUDA).
- ``sampler.py``: temperature → top-k → top-p, behavior logprobs.
- ``spec/``: speculative decoding — the step's modes (plain, chain, tree), the proposer interface,
  drafting, lossless verification, adaptive speculation (its own docstring lists its files).
- ``loaders/``: reading a model from disk — checkpoints (Hugging Face, GGUF), the tokenizer, the
  chat template, registered model names, their error types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specroll.lazy import lazy_exports

if TYPE_CHECKING:
    from specroll.engine.config import EngineConfig
    from specroll.engine.driver import run_to_completion
    from specroll.engine.engine import Engine
    from specroll.engine.loaders.checkpoint import Checkpoint, load_checkpoint
    from specroll.engine.model import CausalLM
    from specroll.engine.sequence import Completion, StepOutput
    from specroll.protocol.sampling import SamplingParams

_EXPORTS = {
    "Engine": "specroll.engine.engine",
    "EngineConfig": "specroll.engine.config",
    "SamplingParams": "specroll.protocol.sampling",
    "StepOutput": "specroll.engine.sequence",
    "Completion": "specroll.engine.sequence",
    "run_to_completion": "specroll.engine.driver",
    "Checkpoint": "specroll.engine.loaders.checkpoint",
    "load_checkpoint": "specroll.engine.loaders.checkpoint",
    "CausalLM": "specroll.engine.model",
}
__all__ = [
    "CausalLM",
    "Checkpoint",
    "Completion",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "StepOutput",
    "load_checkpoint",
    "run_to_completion",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
