"""``[model]``: the policy — the model the trainer trains and every generator serves."""

from __future__ import annotations

from typing import Literal

from specroll.actors.config.section import Section as _Section
from specroll.actors.config.section import check_literals as _check_literals
from specroll.actors.config.section import require as _require
from specroll.engine.loaders.registry import DEFAULT_MODEL


class ModelSection(_Section):
    """The policy: the model the trainer trains and every generator serves (``[model]``)."""

    name: str = DEFAULT_MODEL
    """A registered model name, a Hugging Face checkpoint directory or a ``.gguf`` file. Default: the
    registered default model (SmolLM2-135M-Instruct)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trainer's parameters and optimizer state. Default ``float32``. (The generators'
    inference dtype is ``generator.engine.dtype``.)"""

    def __post_init__(self) -> None:
        _check_literals(self)
        _require(bool(self.name), "name", self.name, "a model name or path")
