"""The synchronous inference core: model, paged KV cache, scheduler, sampler, speculative decoding.

No sockets, no threads, no event loop. The embedding API is importable from here —
``from specroll.engine import Engine, EngineConfig, SamplingParams`` — resolved on first use
(PEP 562), so importing one engine module (``specroll.engine.config``, say) loads only what it needs.
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
