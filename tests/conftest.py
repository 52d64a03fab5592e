"""Shared fixtures: tiny random-weight checkpoints written the way Hugging Face writes them.

The builders behind them, and every other helper tests share, live in ``tests/helpers/``.

``OMP_WAIT_POLICY=PASSIVE`` (unless already set) before anything imports torch: torch's OpenMP threads
then sleep at a barrier instead of spinning on a core. The tiny models' ops are too short to pay for
spinning, and beside other load a spinning thread burns CPU another process needed: the same
tests take about half the CPU time. It only changes how idle threads wait, here and in the processes
the tests start (they inherit the environment), never a result.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP: before any import of it

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.register_assert_rewrite("helpers")  # their asserts report values as a test module's do

from helpers import timeouts  # noqa: E402  (after the rewrite hook)
from helpers.checkpoints import write_tiny_checkpoint  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timeout-factor", type=float, default=1.0, metavar="X",
                     help="multiply every process test's hang guard by X (tests/helpers/timeouts.py); default 1")


def pytest_configure(config: pytest.Config) -> None:
    factor = config.getoption("--timeout-factor")
    if not 0 < factor <= 100:
        raise pytest.UsageError(f"--timeout-factor {factor}: expected a number in (0, 100]")
    timeouts.FACTOR = factor


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``tiny_checkpoint(arch="llama", **config_overrides) -> checkpoint directory``."""

    def make(arch: str = "llama", **overrides: object) -> Path:
        path = tmp_path / f"tiny-{arch}"
        path.mkdir(exist_ok=True)
        write_tiny_checkpoint(path, arch, **overrides)
        return path

    return make


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny random Llama checkpoint (seed 0) for a whole test module whose tests only read it."""
    path = tmp_path_factory.mktemp("tiny-llama") / "tiny"
    path.mkdir()
    write_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct's Q4_1 GGUF) through specroll's loader, dequantized
    to float32: loaded once for every test that reads it (tests/engine/test_checkpoint.py,
    test_smollm2.py), which must not change it. ~0.5 GB for the rest of the session."""
    from specroll.engine.loaders.checkpoint import load_checkpoint

    return load_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own reading of the same GGUF file: its config and its dequantized, un-permuted
    state dict (what ``from_pretrained(gguf_file=...)`` does, minus accelerate) in a float32
    ``LlamaForCausalLM`` in eval mode; loaded once, never changed (as :func:`smollm2`). ~0.5 GB."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from specroll.engine.loaders.registry import resolve_model

    path = resolve_model("smollm2-135m")
    model = LlamaForCausalLM(AutoConfig.from_pretrained(path.parent, gguf_file=path.name)).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # Every converted tensor has its place, and the only one missing is the LM head, tied to the embedding.
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())
    return model
