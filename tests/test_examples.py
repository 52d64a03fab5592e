"""The examples run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.timeouts import guard

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
@pytest.mark.slow
def test_external_trainer_example_trains_and_pushes_weights(tiny_checkpoint) -> None:
    source = (ROOT / "examples" / "external_trainer.py").read_text()
    assert len(source.splitlines()) < 60  # the bound: a foreign loop in under 60 lines
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "external_trainer.py"), "--model", str(tiny_checkpoint()),
         "--steps", "2", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=guard(300),
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


@pytest.mark.integration
@pytest.mark.slow
def test_agentic_external_trainer_example_trains_on_served_turns_and_publishes_weights(tiny_checkpoint) -> None:
    # The calculator prompt (tools, worked examples) is ~1,100 tokens of the tiny tokenizer: past its 512.
    model = tiny_checkpoint(max_position_embeddings=4096)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agentic_external_trainer.py"), "--model", str(model),
         "--steps", "2", "--max-tokens", "8", "--group-size", "2"],
        capture_output=True, text=True, timeout=guard(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"], proc.stdout
    # A random model writes no tool call: each of the 2 x 2 episodes is one turn, one sequence.
    assert all("4 turns in 4 sequences of 4 episodes" in line for line in lines), lines
    assert lines[0].endswith("policy versions [0]") and lines[1].endswith("policy versions [1]"), lines
