"""``bench_drafter_curve.py``'s data: the target's own responses to GSM8K prompts, sampled at T = 1
as RL samples them, generated once with the batched engine and cached as JSONL.

A cache file is named by what makes its rollouts: model, dtype, split, count, response-token cap,
seed and a checksum of the prompts' token ids (so another prompt file or chat template never reads
a stale file). A rerun with the same settings reads it and generates nothing.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specroll.drafter.ttt import Rollout
    from specroll.engine.loaders.checkpoint import Checkpoint

TEMPERATURE = 1.0
"""Every rollout samples at this temperature, without top-k/top-p (as the RL generators do)."""
PROGRESS_EVERY_S = 60.0
"""Seconds between progress lines while generating."""


@dataclass(frozen=True)
class Generation:
    """How a split's rollouts are made: the engine's settings besides the checkpoint."""

    model: str
    dtype: str
    max_tokens: int
    """Response tokens at most per rollout."""
    seed: int
    batch: int
    """``max_num_seqs`` of the generating engine."""
    threads: int | None


@dataclass(frozen=True)
class RolloutSet:
    """One split's rollouts and where they came from."""

    split: str
    rollouts: list[Rollout]
    path: Path
    generated_s: float | None
    """Wall seconds spent generating them now; ``None`` when read from the cache."""

    @property
    def response_tokens(self) -> int:
        return sum(len(r.token_ids) - r.prompt_len for r in self.rollouts)

    def as_json(self) -> dict[str, object]:
        return {"split": self.split, "count": len(self.rollouts), "response_tokens": self.response_tokens,
                "mean_response_tokens": self.response_tokens / max(len(self.rollouts), 1),
                "cache": str(self.path), "generated_s": self.generated_s}


def cache_path(cache_dir: Path, gen: Generation, split: str, prompts: list[list[int]]) -> Path:
    """The cache file of ``prompts``' rollouts under ``gen``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", gen.model).strip("_")
    crc = 0
    for prompt in prompts:
        crc = zlib.crc32(json.dumps(prompt).encode(), crc)
    return cache_dir / f"{slug}-{gen.dtype}-{split}-n{len(prompts)}-t{gen.max_tokens}-s{gen.seed}-p{crc:08x}.jsonl"


def read_rollouts(path: Path, prompts: list[list[int]]) -> list[Rollout] | None:
    """The cached rollouts of ``prompts`` in ``path``, or ``None`` when there is no complete file."""
    from specroll.drafter.ttt import Rollout

    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) != len(prompts) or any(r["prompt_token_ids"] != p for r, p in zip(rows, prompts, strict=True)):
        return None
    return [Rollout(r["prompt_token_ids"] + r["token_ids"], len(r["prompt_token_ids"])) for r in rows]


def generate(checkpoint: Checkpoint, gen: Generation, split: str, prompts: list[list[int]]) -> list[Rollout]:
    """One T = 1 response per prompt (request i seeded ``seed·1000003 + i``), ``gen.batch`` in flight."""
    from specroll.drafter.ttt import Rollout
    from specroll.engine.config import EngineConfig
    from specroll.engine.driver import run_to_completion
    from specroll.engine.engine import Engine
    from specroll.protocol.sampling import SamplingParams

    engine = Engine(EngineConfig(model=gen.model, dtype=gen.dtype, max_num_seqs=gen.batch, seed=gen.seed,
                                 num_threads=gen.threads), checkpoint=checkpoint)
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=TEMPERATURE, top_p=1.0, max_tokens=gen.max_tokens,
                                  seed=gen.seed * 1_000_003 + i)
        engine.add_request(prompt, sampling, f"{split}#{i}")
    start = last = time.perf_counter()
    finished = [0]

    def progress(outputs: list) -> None:
        nonlocal last
        finished[0] += sum(out.finished for out in outputs)
        if time.perf_counter() - last > PROGRESS_EVERY_S:
            last = time.perf_counter()
            print(f"  {split}: {finished[0]}/{len(prompts)} rollouts after {last - start:.0f} s", flush=True)

    done = run_to_completion(engine, progress)
    return [Rollout(prompt + done[f"{split}#{i}"].token_ids, len(prompt)) for i, prompt in enumerate(prompts)]


def load_or_generate(cache_dir: Path, checkpoint: Checkpoint, gen: Generation, split: str,
                     prompts: list[list[int]]) -> RolloutSet:
    """``split``'s rollouts from the cache, or generated now and written there (atomically)."""
    path = cache_path(cache_dir, gen, split, prompts)
    cached = read_rollouts(path, prompts)
    if cached is not None:
        return RolloutSet(split, cached, path, None)
    print(f"generating {len(prompts)} {split} rollouts (T={TEMPERATURE}, <= {gen.max_tokens} tokens, "
          f"{gen.batch} in flight) -> {path}", flush=True)
    start = time.perf_counter()
    rollouts = generate(checkpoint, gen, split, prompts)
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps({"prompt_token_ids": r.token_ids[: r.prompt_len],
                                       "token_ids": r.token_ids[r.prompt_len :]}) + "\n" for r in rollouts))
    os.replace(tmp, path)
    return RolloutSet(split, rollouts, path, seconds)
