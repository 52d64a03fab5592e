"""``specroll drafter init``: a warm-start drafter for a run, made once and cached.

From a run config (``[model]``, ``[task]``, ``[eval]``, ``[generator]`` for the sampling settings,
``[drafter]`` for the head) it

1. generates ``rollouts`` responses with specroll's :class:`~specroll.engine.engine.Engine` to the
   task's training prompts (the trainer's split and chat formatting; a seeded shuffle, one sample
   per prompt and round) at the run's sampling settings (``generator.sampling``: temperature 1 by
   default, as RL samples);
2. trains a fresh head on them with the online drafter trainer's own learner
   (:class:`~specroll.drafter.learner.DrafterLearner`: a cold start's draft vocabulary from the
   rollouts' tokens, then training-time-test steps) until ``budget_minutes`` CPU-minutes of training
   (``time.process_time()``, every thread counted; at least one step) are spent;
3. saves it into the cache (``drafter_cache.py``): ``CACHE_DIR/<key>/``.

The same inputs again are a cache hit: the folder is returned without loading the model.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from specroll.actors.config import ConfigError, RunConfig, load_config, toml_value
from specroll.actors.config.drafter_section import MAX_WARM_START_ROLLOUTS
from specroll.actors.jobs.drafter_cache import (
    WarmStartKey,
    WarmStartMade,
    WarmStartRecord,
    cache_dir_of,
    key_lock,
    lookup,
    publish,
    read_record,
    training_prompts,
    warm_start_key,
)
from specroll.actors.jobs.generate import GenerateError
from specroll.actors.jobs.progress import run_with_progress
from specroll.drafter.eagle_files import write_head_into
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.learner import DrafterLearner
from specroll.drafter.learner_config import LearnerConfig
from specroll.engine.engine import Engine
from specroll.engine.loaders.chat_template import ChatTemplateError
from specroll.engine.loaders.checkpoint import CheckpointError, load_checkpoint, load_model_config
from specroll.engine.loaders.errors import ChecksumError
from specroll.engine.loaders.sealed import check_folder
from specroll.engine.model import CausalLM
from specroll.protocol.sampling import sample_seed
from specroll.rl.tasks import Prompt, TaskSplit, format_question

PROG = "specroll drafter init"

Say = Callable[[str], None]


@dataclass(frozen=True)
class WarmStart:
    """A warm-start head: where it is, whether the cache had it, and how it was made."""

    path: Path
    hit: bool
    record: WarmStartRecord
    seconds: float
    """Wall seconds of this call (a hit: the lookup only)."""


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def run_drafter_init(args: argparse.Namespace) -> None:
    """``specroll drafter init``: find or make the warm-start head of a run config, print its folder
    (stdout, alone on its line) and one line on how (stderr).

    Raises:
        GenerateError: a bad config or flag, no budget, a model or prompts that do not load, an
            unwritable cache; nothing is written when the inputs are bad.
    """
    overrides = list(args.overrides)
    for key, value in (("model.name", args.model), ("task.prompts", args.prompts), ("seed", args.seed)):
        if value is not None:
            overrides.append(f"{key}={toml_value(value)}")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        raise GenerateError(str(exc)) from None
    minutes = args.budget_minutes if args.budget_minutes is not None else config.drafter.warm_start_minutes
    if minutes <= 0:
        raise GenerateError("no training budget: give --budget-minutes M (CPU-minutes, > 0) or set "
                            "drafter.warm_start_minutes in the config")
    rollouts = args.rollouts if args.rollouts is not None else config.drafter.warm_start_rollouts
    made = make_warm_start(config, minutes, rollouts, cache_dir_of(config, args.cache_dir), args.threads)
    _say(describe(made))
    print(made.path, flush=True)


def describe(made: WarmStart) -> str:
    """One line: hit or miss, seconds, what was made, the folder."""
    if made.hit:
        return f"cache hit ({made.seconds:.2f} s): {made.path}"
    m = made.record.made
    return (f"cache miss, made in {made.seconds:.1f} s: {m.rollouts} rollouts ({m.response_tokens} response "
            f"tokens) in {m.generate_s:.1f} s, {m.train_steps} training steps in {m.train_cpu_s:.0f} CPU-s "
            f"({m.train_s:.1f} s, {m.threads} thread{'s' if m.threads != 1 else ''}), loss {m.loss_first:.3f} -> "
            f"{m.loss_last:.3f}, top-1 "
            f"{m.top1_first:.3f} -> {m.top1_last:.3f}: {made.path}")


def make_warm_start(config: RunConfig, budget_minutes: float, rollouts: int, cache_dir: Path,
                    threads: int | None = None, say: Say = _say) -> WarmStart:
    """The cached warm-start head of ``config`` (module docstring), made if missing.

    Args:
        budget_minutes: CPU-minutes of training, > 0.
        rollouts: responses to generate, 1 to ``MAX_WARM_START_ROLLOUTS``.
        cache_dir: the cache's folder (made if missing).
        threads: torch CPU threads for generation and training (None: torch's default).
        say: progress lines of a miss.

    Raises:
        GenerateError: a bad value, model, prompt set or cache folder (nothing written then), or a
            failure to write the cache.
    """
    start = time.monotonic()
    if not budget_minutes > 0 or budget_minutes == float("inf"):
        raise GenerateError(f"budget of {budget_minutes} CPU-minutes; expected a positive finite number")
    if not 1 <= rollouts <= MAX_WARM_START_ROLLOUTS:
        raise GenerateError(f"{rollouts} rollouts; expected an integer in [1, {MAX_WARM_START_ROLLOUTS}]")
    if cache_dir.exists() and not cache_dir.is_dir():
        raise GenerateError(f"cache folder {cache_dir} exists and is not a directory")
    try:
        split = training_prompts(config)
        inputs = warm_start_key(config, split, budget_minutes, rollouts)
    except ValueError as exc:  # PromptFileError too
        raise GenerateError(str(exc)) from None
    except CheckpointError as exc:
        raise GenerateError(f"model.name: {exc}") from None
    key = inputs.digest()
    found = lookup(cache_dir, key)
    if found is not None:
        return _hit(found, start)
    _check_vocab(config)
    try:
        with key_lock(cache_dir, key) as staging:
            found = lookup(cache_dir, key)  # made by a concurrent init while we waited for the lock
            if found is not None:
                return _hit(found, start)
            say(f"cache miss (key {key}): {rollouts} rollouts, then {budget_minutes:g} CPU-minutes of training")
            if threads is not None:
                torch.set_num_threads(threads)
            head, made = _make(config, split, inputs, say)
            write_head_into(staging, head.config, head.cpu_tensors())
            path = publish(staging, cache_dir, key, WarmStartRecord(key=key, inputs=inputs, made=made))
    except OSError as exc:  # the cache's folder, lock or files (named), or a file read meanwhile
        raise GenerateError(f"{exc.filename or cache_dir}: {exc.strerror or exc}") from None
    return WarmStart(path, False, read_record(path), time.monotonic() - start)


def _hit(folder: Path, start: float) -> WarmStart:
    try:
        check_folder(folder)
    except ChecksumError as exc:
        raise GenerateError(f"cached drafter {exc}; remove {folder} to make it again") from None
    try:
        record = read_record(folder)
    except (OSError, msgspec.ValidationError) as exc:
        raise GenerateError(f"cached drafter {folder}: unreadable warm_start.json ({exc}); remove the folder") from None
    return WarmStart(folder, True, record, time.monotonic() - start)


def _check_vocab(config: RunConfig) -> None:
    """A draft vocabulary that fits the model (as ``specroll launch`` checks for a cold start)."""
    try:
        vocab = load_model_config(config.model.name).vocab_size
    except CheckpointError as exc:
        raise GenerateError(f"model.name: {exc}") from None
    if config.drafter.draft_vocab_size > vocab:
        raise GenerateError(f"drafter.draft_vocab_size={config.drafter.draft_vocab_size} exceeds the vocabulary "
                            f"of {config.model.name} ({vocab} tokens); expected at most {vocab}")


def _make(config: RunConfig, split: TaskSplit, inputs: WarmStartKey, say: Say) -> tuple[EagleHead, WarmStartMade]:
    gen_start = time.monotonic()
    rows, tokens = _generate(config, split, inputs.rollouts)
    generate_s = time.monotonic() - gen_start
    say(f"generated {len(rows)} rollouts ({tokens} response tokens) in {generate_s:.1f} s")
    head, steps, cpu_s, train_s, first, last = _train(config, rows, inputs.head, inputs.budget_minutes, say)
    made = WarmStartMade(task=config.task, rollouts=len(rows), response_tokens=tokens, generate_s=round(generate_s, 3),
                         train_steps=steps, train_cpu_s=round(cpu_s, 3), train_s=round(train_s, 3),
                         loss_first=first["loss"], loss_last=last["loss"], top1_first=first["top1_0"],
                         top1_last=last["top1_0"], threads=torch.get_num_threads())
    return head, made


def _encode(config: RunConfig, split: TaskSplit, prompts: list[Prompt]) -> tuple[Engine, list[list[int]]]:
    engine_config = msgspec.structs.replace(config.generator.engine, model=config.model.name, seed=config.seed,
                                            num_threads=torch.get_num_threads(), compile="off",
                                            cuda_graphs="off", draft_length="fixed")
    try:
        engine = Engine(engine_config)
        # As the trainer encodes its prompts (actors/trainer/setup.py).
        ids = [engine.tokenizer.encode_chat(format_question(p.question, split.instruction)) for p in prompts]
    except (CheckpointError, ChatTemplateError, ValueError) as exc:
        raise GenerateError(str(exc)) from None
    return engine, ids


def _generate(config: RunConfig, split: TaskSplit, count: int) -> tuple[list[tuple[list[int], int]], int]:
    """``count`` rollouts (prompt + response ids, prompt length) and their response tokens: round r
    samples the training prompts in the r-th seeded shuffle, one sample each."""
    prompts = split.train
    order = [i for r in range(-(-count // len(prompts)))
             for i in random.Random(f"warm-start-{config.seed}-{r}").sample(range(len(prompts)), len(prompts))][:count]
    engine, ids = _encode(config, split, [prompts[i] for i in sorted(set(order))])
    by_index = dict(zip(sorted(set(order)), ids, strict=True))
    for n, i in enumerate(order):
        params = msgspec.structs.replace(config.generator.sampling, seed=sample_seed(config.seed, n))
        try:
            engine.add_request(by_index[i], params, request_id=str(n))
        except ValueError as exc:
            raise GenerateError(f"prompt {prompts[i].prompt_id!r}: {exc}") from None
    done = run_with_progress(engine, total=count, desc="warm start", disable=not sys.stderr.isatty()).completions
    rows = [(c.prompt_token_ids + c.token_ids, len(c.prompt_token_ids)) for c in (done[str(n)] for n in range(count))]
    return [r for r in rows if r[1] < len(r[0])], sum(len(r[0]) - r[1] for r in rows)


def _train(config: RunConfig, rows: list[tuple[list[int], int]], settings: LearnerConfig, minutes: float,
           say: Say) -> tuple[EagleHead, int, float, float, dict[str, float], dict[str, float]]:
    """A fresh head trained on ``rows`` until ``minutes`` CPU-minutes are spent (at least one step):
    the head, steps, CPU seconds, wall seconds, the first and the last step's metrics."""
    if not rows:
        raise GenerateError("every generated response was empty; nothing to train the drafter on")
    checkpoint = load_checkpoint(config.model.name, dtype=torch.float32)
    with torch.device("meta"):
        model = CausalLM(checkpoint.config)
    model = model.to_empty(device=torch.device(config.drafter.device))
    model.load_weights(checkpoint.weights)
    eos = sorted(set(checkpoint.tokenizer.eos_token_ids) | set(checkpoint.config.eos_token_ids))
    learner = DrafterLearner(model, settings, eos_token_ids=eos)
    for ids, prompt_len in rows:
        learner.add_rollout(ids, prompt_len)
    budget_s, report_every = minutes * 60, minutes * 6  # a progress line per tenth of the budget
    cpu_start, wall_start, next_report = time.process_time(), time.monotonic(), minutes * 6
    first = last = learner.step()
    while (used := time.process_time() - cpu_start) < budget_s:
        last = learner.step()
        if used >= next_report:
            say(f"training: step {learner.steps}, {used:.1f} of {budget_s:.1f} CPU-s, loss {last['loss']:.3f}, "
                f"top-1 {last['top1_0']:.3f}")
            next_report += report_every
    assert learner.head is not None
    return (learner.head, learner.steps, time.process_time() - cpu_start, time.monotonic() - wall_start,
            first, last)
