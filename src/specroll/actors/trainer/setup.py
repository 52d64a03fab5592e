"""What the trainer starts from: the policy (with AdamW; sharded over the trainer's ranks when
there are several), its tokenizer, the prompt order and the held-out evaluation prompts, restored
from ``RUN_DIR/checkpoint`` when one is there; and the trainer's one error type."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from specroll.actors.config import RunConfig
from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_REFUSED
from specroll.actors.trainer.checkpoint import (
    CHECKPOINT_DIRNAME,
    TrainerState,
    load_trainer_checkpoint,
    read_checkpoint,
    read_newest_checkpoint,
)
from specroll.actors.trainer.policy import LocalPolicy, Policy, RankZeroPolicy
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.actors.trainer.ranks.channel import RankChannel
from specroll.actors.trainer.ranks.join import RankError, Ranks, join_group, rank_device
from specroll.actors.trainer.ranks.sharded import ShardedModel
from specroll.actors.trainer.task_load import load_task
from specroll.engine.device import training_precision
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.loaders.tokenizer import Tokenizer
from specroll.engine.model import CausalLM
from specroll.rl.grpo_step import policy_optimizer
from specroll.rl.tasks import Prompt, format_question

log = logging.getLogger("specroll.trainer")


class TrainerError(RuntimeError):
    """The trainer cannot go on; ``exit_code`` is the process exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class TrainerSetup:
    """What the trainer starts from: the policy, tokenizer, prompt order and restored state."""

    policy: Policy
    """The model and its optimizer: in this process, or sharded over the trainer's ranks (``policy.py``)."""
    tokenizer: Tokenizer
    prompts: PromptCycle
    eval_prompts: list[tuple[Prompt, list[int]]]
    """The held-out evaluation prompts with their token ids (chat template applied); empty when
    ``eval.every`` is 0."""
    state: TrainerState
    resumed_from: Path | None
    refused: list[str] = field(default_factory=list)
    """Why each newer checkpoint than ``resumed_from`` was refused (a file missing, cut short or
    changed since it was written), newest first."""


def load_setup(config: RunConfig, ranks: Ranks | None = None, store: dist.Store | None = None) -> TrainerSetup:
    """The policy, tokenizer, optimizer and prompts; restored from the newest checkpoint of
    ``RUN_DIR`` whose files pass their checksums (``checkpoint/``, else ``checkpoint.prev/``), if any.

    With ``ranks`` (rank 0 of a sharded trainer): joins the other ranks' process group unless
    ``store`` says it did already (blocking until they all joined), shards the policy and restores
    the checkpoint into every rank's shards.

    Raises:
        TrainerError: the checkpoint was saved with another seed (exit 2), every checkpoint there
            fails its checksums (exit 2; the message names each file), or ``trainer.device`` is
            ``cuda`` without a CUDA device for this rank (exit 2).
        CheckpointError: a checkpoint that passes its checksums does not load (another model...).
    """
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.model.dtype]
    tc = config.trainer
    try:
        device = rank_device(ranks, tc.device)
    except RankError as e:
        raise TrainerError(str(e), EXIT_REFUSED) from e
    ckpt = load_checkpoint(config.model.name, dtype)
    model = CausalLM(ckpt.config).to(dtype)
    model.load_weights(ckpt.weights)
    split = load_task(config)

    def encode(p: Prompt) -> list[int]:
        if config.task.environment is not None:
            return []  # an episode task: its environment writes the messages
        return ckpt.tokenizer.encode_chat(format_question(p.question, split.instruction))

    token_ids = [encode(p) for p in split.train]
    eval_prompts = [(p, encode(p)) for p in split.eval] if config.eval.every else []
    state = TrainerState(step=0, policy_version=0, prompt_cursor=0, seed=config.seed, model=config.model.name)
    precision = training_precision(tc.precision, device)
    log.info("training precision: %s%s", precision, " (trainer.precision = auto: bf16 only where it is native)"
             if tc.precision == "auto" else "")
    policy: Policy
    if ranks is None:
        model.to(device)
        optimizer = policy_optimizer(model.parameters(), tc.learning_rate, tc.weight_decay)
        policy = LocalPolicy(model, optimizer, tc, device)

        def restore(path: Path) -> TrainerState:
            return load_trainer_checkpoint(path, model, optimizer)  # checks the checksums before loading
    else:
        if store is None:
            store = join_group(ranks, device)
        sharded = ShardedModel(model, ranks, device, tc.learning_rate, tc.weight_decay, torch.get_num_threads())
        rank_zero = RankZeroPolicy(sharded, RankChannel(store, ranks.rank, ranks.world_size, device), tc)
        policy = rank_zero
        shapes = {name: p.shape for name, p in sharded.model.named_parameters()}  # full shapes of the shards

        def restore(path: Path) -> TrainerState:
            saved = read_checkpoint(path, ckpt.config, shapes)  # checks the checksums before reading
            rank_zero.restore(saved)
            return saved.state
    found = read_newest_checkpoint(config.run_dir, restore)
    refused = [str(e) for e in found.refused]
    if found.path is None and refused:
        raise TrainerError(f"no usable checkpoint in {config.run_dir}: {'; '.join(refused)}; move "
                           f"{CHECKPOINT_DIRNAME}/ and {CHECKPOINT_DIRNAME}.prev/ "
                           "out of the run directory to start again from step 0", EXIT_REFUSED)
    if found.path is not None:
        assert found.value is not None
        state = _check_seed(found.value, found.path, config.seed)
    cycle = PromptCycle(token_ids, split.train, config.seed, state.prompt_cursor, state.untrained)
    return TrainerSetup(policy, ckpt.tokenizer, cycle, eval_prompts, state, found.path, refused)


def _check_seed(state: TrainerState, path: Path, seed: int) -> TrainerState:
    if state.seed != seed:
        raise TrainerError(f"{path}: saved with seed {state.seed}, but the config has seed={seed}; "
                           "resume with the same seed or use another run_dir")
    return state
