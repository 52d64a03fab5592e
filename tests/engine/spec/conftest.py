"""Fixtures of the speculation tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def chi_square_model(tmp_path_factory):
    """A tiny random Llama (seed 1) whose distributions the chi-square tests bin."""
    from helpers.checkpoints import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("chi") / "tiny"
    path.mkdir()
    write_tiny_checkpoint(path, "llama", seed=1)
    return path
