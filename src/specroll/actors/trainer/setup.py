"""What the trainer starts from: the policy (with AdamW; sharded over the trainer's ranks when
there are several), its tokenizer, the prompt order and the held-out evaluation prompts, restored
from ``RUN_DIR/checkpoint`` when one is there; and the trainer's one error type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from specroll.actors.config import RunConfig
from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_REFUSED
from specroll.actors.trainer.checkpoint import TrainerState, find_checkpoint, load_trainer_checkpoint, read_checkpoint
from specroll.actors.trainer.policy import LocalPolicy, Policy, RankZeroPolicy
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.actors.trainer.ranks.channel import RankChannel
from specroll.actors.trainer.ranks.join import RankError, Ranks, join_group, rank_device
from specroll.actors.trainer.ranks.sharded import ShardedModel
from specroll.actors.trainer.task_load import load_task
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.loaders.tokenizer import Tokenizer
from specroll.engine.model import CausalLM
from specroll.rl.grpo_step import policy_optimizer
from specroll.rl.tasks import Prompt, format_question


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


def load_setup(config: RunConfig, ranks: Ranks | None = None, store: dist.Store | None = None) -> TrainerSetup:
    """The policy, tokenizer, optimizer and prompts; restored from ``RUN_DIR/checkpoint`` if present.

    With ``ranks`` (rank 0 of a sharded trainer): joins the other ranks' process group unless
    ``store`` says it did already (blocking until they all joined), shards the policy and restores
    the checkpoint into every rank's shards.

    Raises:
        TrainerError: the checkpoint was saved with another seed (exit 2), or ``trainer.device`` is
            ``cuda`` without a CUDA device for this rank (exit 2).
        CheckpointError: the checkpoint does not load.
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
    path = find_checkpoint(config.run_dir)
    policy: Policy
    if ranks is None:
        model.to(device)
        optimizer = policy_optimizer(model.parameters(), tc.learning_rate, tc.weight_decay)
        policy = LocalPolicy(model, optimizer, tc, device)
        if path is not None:
            state = _check_seed(load_trainer_checkpoint(path, model, optimizer), path, config.seed)
    else:
        if store is None:
            store = join_group(ranks, device)
        sharded = ShardedModel(model, ranks, device, tc.learning_rate, tc.weight_decay, torch.get_num_threads())
        rank_zero = RankZeroPolicy(sharded, RankChannel(store, ranks.rank, ranks.world_size, device), tc)
        policy = rank_zero
        if path is not None:
            shapes = {name: p.shape for name, p in sharded.model.named_parameters()}  # full shapes of the shards
            saved = read_checkpoint(path, ckpt.config, shapes)
            state = _check_seed(saved.state, path, config.seed)
            rank_zero.restore(saved)
    cycle = PromptCycle(token_ids, split.train, config.seed, state.prompt_cursor, state.untrained)
    return TrainerSetup(policy, ckpt.tokenizer, cycle, eval_prompts, state, path)


def _check_seed(state: TrainerState, path: Path, seed: int) -> TrainerState:
    if state.seed != seed:
        raise TrainerError(f"{path}: saved with seed {state.seed}, but the config has seed={seed}; "
                           "resume with the same seed or use another run_dir")
    return state
