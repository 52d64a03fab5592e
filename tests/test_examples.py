"""The examples run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
@pytest.mark.slow
def test_external_trainer_example_trains_and_pushes_weights(tiny_checkpoint) -> None:
    source = (ROOT / "examples" / "external_trainer.py").read_text()
    assert len(source.splitlines()) < 60  # the bound: a foreign loop in under 60 lines
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "external_trainer.py"), "--model", str(tiny_checkpoint()),
         "--steps", "2", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"]
    assert "policy version 2 served" in lines[-1]


def test_the_docs_and_the_example_agree_on_the_time_a_step_takes() -> None:
    import re

    pattern = re.compile(r"about (\d+) s a step on a 2-core CPU")
    found = {}
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md", ROOT / "examples" / "gsm8k_smollm2.toml"):
        found[page.name] = set(pattern.findall(" ".join(page.read_text().split())))
    assert all(found.values()) and len(set(map(frozenset, found.values()))) == 1, found
