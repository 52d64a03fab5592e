"""``trainer.precision = "auto"``: bf16 only where the CPU has it natively; fp32 and bf16 stand for
themselves; anything else is refused by name."""

from __future__ import annotations

import pytest
import torch

from specroll.engine import device as device_module
from specroll.engine.device import training_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "fp32")])
def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(monkeypatch: pytest.MonkeyPatch, native: bool,
                                                     expected: str) -> None:
    monkeypatch.setattr(device_module, "_cpu_has_native_bf16", lambda: native)
    assert training_precision("auto", CPU) == expected
    assert training_precision("fp32", CPU) == "fp32" and training_precision("bf16", CPU) == "bf16"


def test_an_unknown_precision_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="precision 'fp16', expected 'auto', 'fp32' or 'bf16'"):
        training_precision("fp16", CPU)
