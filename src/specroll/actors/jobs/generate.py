"""``specroll generate``: rollouts for a prompt set, written as JSONL with logprobs and versions."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from specroll.actors.jobs.progress import run_with_progress
from specroll.drafter.eagle import EagleProposer
from specroll.drafter.suffix import SuffixProposer
from specroll.engine.config import EngineConfig
from specroll.engine.engine import Engine
from specroll.engine.loaders.chat_template import ChatTemplateError
from specroll.engine.loaders.checkpoint import CheckpointError
from specroll.protocol.sampling import SamplingParams
from specroll.rl.tasks import (
    Prompt,
    PromptFileError,
    RewardFn,
    builtin_prompts,
    format_question,
    get_reward,
    load_prompts,
)

if TYPE_CHECKING:
    from specroll.engine.loaders.tokenizer import Tokenizer


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
    if Path(args.out).is_dir():
        raise GenerateError(f"--out {args.out} is a directory; expected a file path")
    prompts = _load_task(args)
    reward_fn = None if args.reward == "none" else get_reward(args.reward)
    try:
        base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_tokens=args.max_tokens)
    except ValueError as exc:
        raise GenerateError(str(exc)) from None
    with _AtomicOutput(Path(args.out)) as output:
        _generate(args, prompts, base, reward_fn, output)


def _generate(args: argparse.Namespace, prompts: list[Prompt], base: SamplingParams,
              reward_fn: RewardFn | None, output: _AtomicOutput) -> None:
    engine = _build_engine(args)
    tok = engine.tokenizer
    if tok.chat_template is None:
        print("specroll generate: the checkpoint has no chat template; prompts are encoded as plain text",
              file=sys.stderr)
    prompt_ids = {}
    for p in prompts:
        ids = _encode_prompt(tok, p.question)
        if len(ids) >= engine.max_model_len:
            raise GenerateError(
                f"prompt {p.prompt_id!r} has {len(ids)} tokens with the chat template; the model's "
                f"context holds {engine.max_model_len}, leaving no room for a response "
                f"(raise --max-model-len to at least {len(ids) + 1} if the model allows)"
            )
        prompt_ids[p.prompt_id] = ids
    for j, p in enumerate(prompts):
        for i in range(args.n):
            seed = (args.seed * 1_000_003 + j) * 1_000_003 + i
            engine.add_request(prompt_ids[p.prompt_id], msgspec.structs.replace(base, seed=seed),
                               request_id=f"{p.prompt_id}#{i}", group_id=p.prompt_id)

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
                reward=None if reward_fn is None or p.answer is None else reward_fn(response, p.answer),
            ))
    output.commit(records)
    rewards = [r.reward for r in records if r.reward is not None]
    mean_reward = f"{sum(rewards) / len(rewards):.3f}" if rewards else "n/a"
    print(
        f"{len(records)} rollouts, {num_tokens} tokens in {elapsed:.1f} s ({num_tokens / elapsed:.1f} tok/s), "
        f"mean reward {mean_reward}{_speculation_summary(engine)} -> {args.out}"
    )


def _speculation_summary(engine: Engine) -> str:
    if engine.proposer is None:
        return ""
    stats = engine.spec_stats
    if not stats.num_drafted:
        return ", nothing drafted"
    return (f", {stats.num_accepted}/{stats.num_drafted} drafts accepted, "
            f"acceptance length {stats.acceptance_length:.2f}")


def _build_engine(args: argparse.Namespace) -> Engine:

    if args.drafter is not None and args.speculative not in ("eagle", "tree", "auto"):
        raise GenerateError(f"--drafter {args.drafter} is used only with --speculative eagle, tree or auto, "
                            f"not {args.speculative}")
    if args.speculative in ("eagle", "tree") and args.drafter is None:
        raise GenerateError(f"--speculative {args.speculative} needs --drafter DIR (a drafter made by "
                            "'specroll init-drafter')")
    try:
        config = EngineConfig(
            model=args.model, backend=args.backend, device=args.device, dtype=args.dtype,
            kv_cache_memory_gb=args.kv_cache_gb, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed, num_threads=args.threads, num_draft_tokens=args.num_draft_tokens,
            draft_length={"auto": "adaptive", "tree": "tree"}.get(args.speculative, "fixed"),
            draft_trees=args.draft_trees, compile=args.compile, compile_cache_dir=args.compile_cache_dir,
        )
        return Engine(config, proposer=_build_proposer(args, config.page_size))
    except (CheckpointError, ValueError) as exc:
        raise GenerateError(str(exc)) from None


def _build_proposer(args: argparse.Namespace, page_size: int) -> EagleProposer | SuffixProposer | None:
    if args.speculative == "off":
        return None
    if args.drafter is not None:
        return EagleProposer(args.drafter, page_size=page_size, seed=args.seed)
    return SuffixProposer()


def _encode_prompt(tok: Tokenizer, question: str) -> list[int]:
    """The chat-formatted prompt, or the plain question and instruction for a base model."""
    messages = format_question(question)
    if tok.chat_template is None:
        return tok.encode(messages[-1]["content"])
    try:
        return tok.encode_chat(messages)
    except ChatTemplateError as exc:
        raise GenerateError(str(exc)) from None


_MKDIR_ATTEMPTS = 5


class _AtomicOutput:
    """The output file, written all at once: a temporary file beside it is created before any work
    (so an unwritable path fails at once) and renamed over it on success; on failure the temporary
    file and any folders made for it are removed, and an existing output is left untouched."""
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> _AtomicOutput:
        self._made: list[Path] = []  # folders this run created, deepest first
        # Another run sharing a parent folder may remove it (its own failed run's folder) between
        # our finding it and making a child in it: a vanished parent is looked for again, a few times.
        for attempt in range(_MKDIR_ATTEMPTS):
            try:
                fd, tmp = self._make_temporary()
                break
            except FileNotFoundError as exc:
                self._remove_made()
                if attempt == _MKDIR_ATTEMPTS - 1:
                    raise GenerateError(f"--out {self.path}: cannot write there ({exc.strerror})") from None
            except OSError as exc:
                self._remove_made()
                raise GenerateError(f"--out {self.path}: cannot write there ({exc.strerror})") from None
        self._file, self._tmp = os.fdopen(fd, "wb"), Path(tmp)
        return self

    def _make_temporary(self) -> tuple[int, str]:
        self._made = []
        missing = []
        parent = self.path.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:  # made meanwhile by someone else: not ours to remove
                continue
            self._made.insert(0, folder)
        return tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")

    def commit(self, records: list[RolloutRecord]) -> None:
        encoder = msgspec.json.Encoder()
        try:
            for r in records:
                self._file.write(encoder.encode(r) + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())  # on disk before the rename makes it the output
            self._file.close()
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self._tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
            os.replace(self._tmp, self.path)
        except OSError as exc:
            raise GenerateError(f"cannot write {self.path}: {exc}") from None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._file.close()
        if self._tmp.exists():  # not committed
            self._tmp.unlink()
            self._remove_made()

    def _remove_made(self) -> None:
        for folder in self._made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break
