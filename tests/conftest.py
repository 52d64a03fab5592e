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
