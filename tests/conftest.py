"""Shared fixtures: tiny random-weight checkpoints written the way Hugging Face writes them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from tiny_model import CHAT_TEMPLATE, TINY_VOCAB, write_tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "TINY_VOCAB", "write_tiny_tokenizer"]


def hf_tiny_config(arch: str, **overrides: object):
    """A transformers config for a tiny Llama / Qwen2 / Qwen3."""
    import transformers

    kw: dict[str, object] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=arch == "llama", eos_token_id=2, bos_token_id=None, rope_theta=10000.0,
    )
    if arch == "qwen3":
        kw["head_dim"] = 32
    kw.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    return cls[arch](**kw)


def write_tiny_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides: object):
    """Save a random-weight model (and tokenizer) to ``path``; return the transformers model."""
    import transformers

    torch.manual_seed(seed)
    config = hf_tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all near-uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return model


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``tiny_checkpoint(arch="llama", **config_overrides) -> checkpoint directory``."""

    def make(arch: str = "llama", **overrides: object) -> Path:
        path = tmp_path / f"tiny-{arch}"
        path.mkdir(exist_ok=True)
        write_tiny_checkpoint(path, arch, **overrides)
        return path

    return make


def teacher_forced_logits(engine, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float32 ``[len(response), V]``: ``engine``'s model logits predicting each response token,
    from one prefill of prompt + response on scratch pages 0..7 of its KV cache."""
    from specroll.engine.batch import build_metadata

    ids = torch.tensor(prompt + response)
    meta = build_metadata([len(ids)], [len(ids)], [list(range(8))], engine.config.page_size)
    engine.backend.plan(meta)
    hidden, _ = engine.model(ids, meta.positions(), engine.kv_caches, engine.backend)
    return engine.model.compute_logits(hidden)[len(prompt) - 1 : -1]


@contextlib.contextmanager
def actor_process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` in its own process group, output to ``log``; the whole group is killed and reaped on the way out."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def generator_process(
    endpoint: str, model: Path, log: Path, *extra: str, actor_id: str = "gen-0", kv_gb: float = 0.02
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``python -m specroll.actors.generator`` as an :func:`actor_process` (float32, 1 thread, fast heartbeats)."""
    cmd = [sys.executable, "-m", "specroll.actors.generator", "--connect", endpoint, "--model", str(model),
           "--actor-id", actor_id, "--dtype", "float32", "--kv-cache-gb", str(kv_gb), "--threads", "1",
           "--heartbeat-s", "0.2", "--stats-s", "0.5", "--trainer-timeout-s", "30", *extra]
    return actor_process(cmd, log)


def drafter_process(
    endpoint: str, config: Path, log: Path, actor_id: str = "drafter-0"
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``python -m specroll.actors.drafter_trainer`` with run config ``config``, as an :func:`actor_process`."""
    return actor_process([sys.executable, "-m", "specroll.actors.drafter_trainer", "--connect", endpoint, "--config",
                          str(config), "--actor-id", actor_id], log)


async def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; a hang guard of ``timeout`` seconds names ``what`` was awaited."""
    import anyio

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await anyio.sleep(0.05)
