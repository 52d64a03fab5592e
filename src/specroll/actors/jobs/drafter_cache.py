"""The warm-start drafter cache of ``specroll drafter init`` (and of ``specroll launch``, which looks a
head up here before it makes one): one folder per key, ``CACHE_DIR/<key>/`` holding the head
(``config.json``, ``model.safetensors``) and ``warm_start.json`` (the key's inputs and how the head
was made).

The key is the SHA-256 of what determines the head (:class:`WarmStartKey`): the model's files (path,
size and mtime of each: cheap, and a checkpoint rewritten in place gets a new mtime), the training
prompts themselves (a digest of their text and instruction: whatever ``[task]`` and ``[eval]``
settings chose them), the sampling settings the rollouts are drawn with, the head's training
settings, the CPU-minute budget, the rollout count and the seed. Imports no torch: the launcher
computes a key and finds a cached head without loading the model.

A folder is complete or absent: a head is written into a staging folder beside it, sealed (every
file fsynced, its size and SHA-256 in ``checksums.json``: ``engine/loaders/sealed.py``) and renamed
into place (one ``rename``), under an exclusive ``flock`` on the key, so two concurrent inits never
see a half-written head and the second waits for the first and finds its head. A hit checks the
checksums (``drafter_init.py``): a cached head changed since is refused, naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec

from specroll.actors.config import RunConfig
from specroll.actors.config.task_section import TaskConfig
from specroll.actors.trainer.task_load import load_task
from specroll.drafter.learner_config import LearnerConfig
from specroll.engine.loaders.registry import resolve_model
from specroll.engine.loaders.sealed import seal
from specroll.protocol.sampling import SamplingParams
from specroll.rl.tasks import TaskSplit

KEY_FORMAT = 1
"""Raised when what a key's inputs mean changes (how rollouts are drawn, how the head is trained)."""
RECORD_FILE = "warm_start.json"
"""Written last into a staging folder: a cache folder holding it is complete."""


class FileStamp(msgspec.Struct, frozen=True):
    """One file's identity: name, size in bytes, modification time in nanoseconds."""

    name: str
    size: int
    mtime_ns: int


class WarmStartKey(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that determines a warm-start head (the module docstring); its :meth:`digest` is the key."""

    format: int = KEY_FORMAT
    model: str
    """The model's checkpoint, resolved to an absolute path (a registered name to its file)."""
    model_files: list[FileStamp]
    train_prompts: int
    """The task's training prompts (``[task]``, less what ``[eval]`` holds out)."""
    train_prompts_sha256: str
    """Of their questions and the task's instruction, as the trainer formats them."""
    sampling: SamplingParams
    engine_dtype: str
    max_model_len: int | None
    head: LearnerConfig
    """The head's architecture, taps, draft vocabulary and training settings (``[drafter]``)."""
    budget_minutes: float
    """CPU-minutes (``time.process_time()``) of training."""
    rollouts: int
    seed: int

    def digest(self) -> str:
        """24 hex digits of the SHA-256 of the canonical JSON (fields in declaration order)."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:24]


class WarmStartMade(msgspec.Struct, frozen=True, kw_only=True):
    """How a cached head was made (for the reader of ``warm_start.json``)."""

    task: TaskConfig
    """The run's ``[task]`` (what the training prompts came from)."""
    rollouts: int
    response_tokens: int
    generate_s: float
    """Wall seconds of generation."""
    train_steps: int
    train_cpu_s: float
    """CPU seconds (``time.process_time()``) of training: the budget, overshot by at most one step."""
    train_s: float
    """Wall seconds of training."""
    loss_first: float
    loss_last: float
    top1_first: float
    """Top-1 agreement of the first draft step with the target, at the first and the last step."""
    top1_last: float
    threads: int


class WarmStartRecord(msgspec.Struct, frozen=True, kw_only=True):
    """``warm_start.json``: the key, its inputs and how the head was made."""

    key: str
    inputs: WarmStartKey
    made: WarmStartMade


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/specroll/drafters`` (``~/.cache/specroll/drafters`` without it), as the
    compile cache's ``.../specroll/compile``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specroll" / "drafters"


def cache_dir_of(config: RunConfig, override: str | None = None) -> Path:
    """``override``, else ``drafter.warm_start_cache_dir``, else :func:`default_cache_dir`; ``~`` expanded."""
    chosen = override if override is not None else config.drafter.warm_start_cache_dir
    return Path(chosen).expanduser() if chosen is not None else default_cache_dir()


def head_settings(config: RunConfig, rollouts: int) -> LearnerConfig:
    """The learner settings of a warm start: ``[drafter]``'s, with every rollout in the replay buffer
    and training from the first (all rollouts are there before the first step)."""
    return dataclasses.replace(config.drafter.learner_config(config.seed), buffer_rollouts=rollouts, min_rollouts=1)


def _stamps(path: Path) -> list[FileStamp]:
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")) if path.is_dir() else [path]
    stamps = []
    for f in files:
        st = f.stat()
        stamps.append(FileStamp(f.name, st.st_size, st.st_mtime_ns))
    return stamps


def warm_start_key(config: RunConfig, split: TaskSplit, budget_minutes: float, rollouts: int) -> WarmStartKey:
    """The key's inputs for a warm start of ``config`` on ``split``'s training prompts (the model's
    files are only stat'ed).

    Raises:
        CheckpointError: ``model.name`` is neither a path nor a registered model.
    """
    model = resolve_model(config.model.name).resolve()
    digest = hashlib.sha256(split.instruction.encode())
    for p in split.train:
        digest.update(b"\0" + p.question.encode())
    engine = config.generator.engine
    return WarmStartKey(model=str(model), model_files=_stamps(model), train_prompts=len(split.train),
                        train_prompts_sha256=digest.hexdigest(), sampling=config.generator.sampling,
                        engine_dtype=engine.dtype, max_model_len=engine.max_model_len,
                        head=head_settings(config, rollouts), budget_minutes=budget_minutes, rollouts=rollouts,
                        seed=config.seed)


def training_prompts(config: RunConfig) -> TaskSplit:
    """The run's prompts, split as the trainer splits them (``load_task``).

    Raises:
        ValueError: an episode task (``task.environment``), or a split that leaves nothing to train on.
        PromptFileError: a prompt file cannot be read or is malformed.
    """
    if config.task.environment is not None:
        raise ValueError(f"task.environment = {config.task.environment!r}: a warm start samples single-turn "
                         "responses to the task's prompts; expected a run without task.environment")
    return load_task(config)


def lookup(cache_dir: Path, key: str) -> Path | None:
    """The cached head's folder for ``key``, or None (a folder is there only complete)."""
    folder = cache_dir / key
    return folder if (folder / RECORD_FILE).is_file() else None


def read_record(folder: Path) -> WarmStartRecord:
    """``warm_start.json`` of a cached head.

    Raises:
        OSError, msgspec.ValidationError: missing or malformed.
    """
    return msgspec.json.decode((folder / RECORD_FILE).read_bytes(), type=WarmStartRecord)


def make_cache_dir(cache_dir: Path) -> None:
    """Make the cache folder (and its parents) if missing; check that it is a writable directory.

    Raises:
        OSError: it cannot be made, is not a directory, or cannot be written.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise PermissionError(f"{cache_dir} is not writable")


@contextlib.contextmanager
def key_lock(cache_dir: Path, key: str) -> Iterator[Path]:
    """Hold the key's exclusive lock (``flock`` on ``CACHE_DIR/.<key>.lock``; released when the process
    dies) and yield a fresh staging folder for its head; staging folders left by a killed init are
    removed first.

    Raises:
        OSError: the cache folder cannot be made or written.
    """
    make_cache_dir(cache_dir)
    with (cache_dir / f".{key}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in cache_dir.glob(f".{key}.staging-*"):  # their writers are gone: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = cache_dir / f".{key}.staging-{os.getpid()}"
        staging.mkdir()
        try:
            yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # published (renamed away) or abandoned


def publish(staging: Path, cache_dir: Path, key: str, record: WarmStartRecord) -> Path:
    """Write ``warm_start.json`` into ``staging`` (which holds the head), seal it (``sealed.seal``) and
    rename it to ``CACHE_DIR/<key>``; returns that folder. Called under :func:`key_lock`.

    Raises:
        OSError: the folder cannot be written or renamed (a full disk too).
    """
    (staging / RECORD_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(record), indent=1) + b"\n")
    seal(staging)
    final = cache_dir / key
    if final.exists() and lookup(cache_dir, key) is None:  # not ours (made by hand?): incomplete, replaced
        shutil.rmtree(final)
    os.rename(staging, final)
    return final
