"""``specroll generate``: rollouts for a prompt set, written as JSONL with logprobs and versions."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import msgspec

from specroll.actors.tasks import (
    Prompt,
    PromptFileError,
    builtin_prompts,
    format_question,
    get_reward,
    load_prompts,
)


class GenerateError(Exception):
    """A user-facing failure of ``specroll generate``; the message says what to fix."""


class RolloutRecord(msgspec.Struct, frozen=True):
    """One line of the output file."""

    prompt_id: str
    sample_index: int
    prompt: str
    response: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Behavior logprob (natural log) of each response token under its processed distribution."""
    versions: list[int]
    """Policy version of the weights that produced each response token."""
    finish_reason: str
    answer: str | None
    reward: float | None


def _load_task(args: argparse.Namespace) -> list[Prompt]:
    if args.prompts is None:
        prompts = builtin_prompts(args.num_builtin, seed=args.seed)
        return prompts[: args.limit] if args.limit else prompts
    try:
        return load_prompts(args.prompts, limit=args.limit)
    except PromptFileError as exc:
        raise GenerateError(str(exc)) from None


def run_generate(args: argparse.Namespace) -> None:
    """Generate ``args.n`` rollouts per prompt and write them atomically to ``args.out``.

    Raises:
        GenerateError: bad prompts file, model, sampling value or a prompt too long; nothing is
            written then.
    """
    from specroll.protocol.sampling import SamplingParams

    _check_out_path(Path(args.out))
    prompts = _load_task(args)
    reward_fn = None if args.reward == "none" else get_reward(args.reward)
    try:
        base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_tokens=args.max_tokens)
    except ValueError as exc:
        raise GenerateError(str(exc)) from None
    engine = _build_engine(args)
    tok = engine.tokenizer
    prompt_ids = {}
    for p in prompts:
        ids = tok.encode_chat(format_question(p.question))
        if len(ids) >= engine.max_model_len:
            raise GenerateError(
                f"prompt {p.prompt_id!r} has {len(ids)} tokens with the chat template; the model's "
                f"context holds {engine.max_model_len}"
            )
        prompt_ids[p.prompt_id] = ids
    for j, p in enumerate(prompts):
        for i in range(args.n):
            seed = (args.seed * 1_000_003 + j) * 1_000_003 + i
            engine.add_request(prompt_ids[p.prompt_id], msgspec.structs.replace(base, seed=seed),
                               request_id=f"{p.prompt_id}#{i}", group_id=p.prompt_id)

    from specroll.actors.progress import run_with_progress

    run = run_with_progress(engine, total=len(prompts) * args.n, disable=args.no_progress)
    done, num_tokens, elapsed = run.completions, run.num_tokens, run.seconds

    records = []
    for p in prompts:
        for i in range(args.n):
            c = done[f"{p.prompt_id}#{i}"]
            response = tok.decode(c.token_ids)
            records.append(RolloutRecord(
                prompt_id=p.prompt_id, sample_index=i, prompt=p.question, response=response,
                prompt_token_ids=c.prompt_token_ids, token_ids=c.token_ids, logprobs=c.logprobs,
                versions=c.versions, finish_reason=c.finish_reason, answer=p.answer,
                reward=None if reward_fn is None else reward_fn(response, p.answer),
            ))
    try:
        _write_atomic(Path(args.out), records)
    except OSError as exc:
        raise GenerateError(f"cannot write {args.out}: {exc}") from None
    rewards = [r.reward for r in records if r.reward is not None]
    mean_reward = f"{sum(rewards) / len(rewards):.3f}" if rewards else "n/a"
    print(
        f"{len(records)} rollouts, {num_tokens} tokens in {elapsed:.1f} s ({num_tokens / elapsed:.1f} tok/s), "
        f"mean reward {mean_reward} -> {args.out}"
    )


def _build_engine(args: argparse.Namespace):  # -> Engine, imported lazily (torch)
    from specroll.engine.checkpoint import CheckpointError
    from specroll.engine.config import EngineConfig
    from specroll.engine.engine import Engine

    try:
        config = EngineConfig(
            model=args.model, backend=args.backend, device=args.device, dtype=args.dtype,
            kv_cache_memory_gb=args.kv_cache_gb,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed, num_threads=args.threads,
        )
        return Engine(config)
    except (CheckpointError, ValueError) as exc:
        raise GenerateError(str(exc)) from None


def _check_out_path(path: Path) -> None:
    """Fail before generating when the output cannot be written."""
    if path.is_dir():
        raise GenerateError(f"--out {path} is a directory; expected a file path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise GenerateError(f"--out {path}: {parent} is not a writable directory")


def _write_atomic(path: Path, records: list[RolloutRecord]) -> None:
    """Write JSONL to a temporary file beside ``path`` and rename it: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            encoder = msgspec.json.Encoder()
            for r in records:
                f.write(encoder.encode(r) + b"\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
