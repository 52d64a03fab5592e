"""``gpu_plan.py``: on a multi-GPU host each CUDA role gets GPUs of its own, and the environment the
launcher gives a role reaches it whether it is forked or a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specroll.actors.config import load_config
from specroll.actors.launch.gpu_plan import gpu_env
from specroll.actors.launch.role_fork import Forker, fork_supported
from specroll.actors.launch.role_process import start_role

WAIT_S = 120  # a hang guard only


def plan(*overrides: str) -> dict[str, dict[str, str]]:
    return gpu_env(load_config(None, list(overrides)), "drafter")


def test_trainer_ranks_first_then_one_gpu_per_generator_then_the_drafter() -> None:
    got = plan("trainer.world_size=4", "trainer.batch_groups=4", "trainer.device=cuda", "generator.count=3",
               "generator.engine.device=cuda", "drafter.enabled=true", "drafter.device=cuda",
               "generator.speculative=auto")
    assert got == {"generator-0": {"CUDA_VISIBLE_DEVICES": "4"}, "generator-1": {"CUDA_VISIBLE_DEVICES": "5"},
                   "generator-2": {"CUDA_VISIBLE_DEVICES": "6"}, "drafter": {"CUDA_VISIBLE_DEVICES": "7"}}


def test_a_trainer_on_the_cpu_leaves_the_first_gpus_to_the_generators() -> None:
    got = plan("generator.count=2", "generator.engine.device=cuda")
    assert got == {"generator-0": {"CUDA_VISIBLE_DEVICES": "0"}, "generator-1": {"CUDA_VISIBLE_DEVICES": "1"}}


@pytest.mark.parametrize("overrides", [
    ("generator.count=2",),  # every role on the CPU
    ("generator.engine.device=cuda:1",),  # an explicit device: the user's choice
    ("generator.engine.device=cuda", "launch.gpu_per_role=false"),
])
def test_no_pinning(overrides: tuple[str, ...]) -> None:
    assert plan(*overrides) == {}


@pytest.mark.integration
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_the_role_sees_the_environment_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    forked: bool) -> None:
    if forked and not fork_supported():
        pytest.skip("forking roles needs Linux")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the fresh interpreter finds the module too
    (tmp_path / "env_role.py").write_text(textwrap.dedent("""
        import os
        print("visible=" + os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    """))
    log = tmp_path / "role.log"
    proc = start_role("env-role", ["env_role"], log, Forker(None) if forked else None,
                      env={"CUDA_VISIBLE_DEVICES": "5"})
    assert proc.popen.wait(timeout=WAIT_S) == 0
    assert "visible=5" in log.read_text()


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
@pytest.mark.parametrize("key", ["generator.engine.device=cuda", "trainer.device=cuda"])
def test_a_cuda_role_on_a_host_without_cuda_is_refused_before_anything_starts(tmp_path: Path, key: str) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"run_dir = {json.dumps(str(run_dir))}\n")
    proc = subprocess.run([sys.executable, "-m", "specroll.actors.cli", "launch", str(config), "--set", key],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 2, proc.stderr
    assert f"{key.split('=')[0]}='cuda', but this host has no CUDA device" in proc.stderr, proc.stderr
    assert "started" not in proc.stderr and not (run_dir / "logs").exists()


@pytest.mark.integration
@pytest.mark.parametrize(("sets", "expected"), [
    (["generator.engine.cuda_graphs=on"],
     "cuda_graphs='on' needs device 'cuda' and the flashinfer backend; got device 'cpu'"),
    (["generator.engine.cuda_graphs=emulate", "generator.engine.cuda_graph_batch_sizes=[128]"],
     "cuda_graph_batch_sizes=[128]: expected sizes at most max_num_seqs"),
])
def test_cuda_graph_settings_that_cannot_run_are_refused_before_anything_starts(
    tmp_path: Path, sets: list[str], expected: str
) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"run_dir = {json.dumps(str(run_dir))}\n")
    args = [a for key in sets for a in ("--set", key)]
    proc = subprocess.run([sys.executable, "-m", "specroll.actors.cli", "launch", str(config), *args],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "started" not in proc.stderr and not run_dir.exists()
