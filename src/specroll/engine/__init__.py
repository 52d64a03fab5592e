"""The synchronous generation core: model, paged KV cache, scheduler, sampler, speculative decoding, engine.

``from specroll.engine import Engine, EngineConfig, SamplingParams`` is the public entry point; the
names are resolved on first use (PEP 562), so importing a light module such as
``specroll.engine.config`` does not import the model, torch or the tokenizer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine
    from specroll.engine.sequence import Completion, StepOutput
    from specroll.protocol.sampling import SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams", "StepOutput"]

_HOME = {
    "Completion": "specroll.engine.sequence",
    "Engine": "specroll.engine.engine",
    "EngineConfig": "specroll.engine.config",
    "SamplingParams": "specroll.protocol.sampling",
    "StepOutput": "specroll.engine.sequence",
}
"""Public name → the module that defines it."""


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
