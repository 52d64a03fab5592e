"""What the trainer starts from: the policy, its tokenizer, AdamW, the prompt order and the held-out
evaluation prompts, restored from ``RUN_DIR/checkpoint`` when one is there; and the trainer's one
error type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specroll.actors.config import RunConfig
from specroll.actors.exit_codes import EXIT_FAILED
from specroll.actors.trainer.checkpoint import TrainerState, find_checkpoint, load_trainer_checkpoint
from specroll.actors.trainer.prompt_cycle import PromptCycle
from specroll.actors.trainer.task_load import load_task
from specroll.engine.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.engine.tokenizer import Tokenizer
from specroll.rl.tasks import Prompt, format_question


class TrainerError(RuntimeError):
    """The trainer cannot go on; ``exit_code`` is the process exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class TrainerSetup:
    """What the trainer starts from: the policy, tokenizer, optimizer, prompt order and restored state."""

    model: CausalLM
    tokenizer: Tokenizer
    optimizer: torch.optim.Optimizer
    prompts: PromptCycle
    eval_prompts: list[tuple[Prompt, list[int]]]
    """The held-out evaluation prompts with their token ids (chat template applied); empty when
    ``eval.every`` is 0."""
    state: TrainerState
    resumed_from: Path | None


def load_setup(config: RunConfig) -> TrainerSetup:
    """The policy, tokenizer, optimizer and prompts; restored from ``RUN_DIR/checkpoint`` if present."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.model.dtype]
    ckpt = load_checkpoint(config.model.name, dtype)
    model = CausalLM(ckpt.config).to(dtype)
    model.load_weights(ckpt.weights)
    tc = config.trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
    split = load_task(config)

    def encode(p: Prompt) -> list[int]:
        return ckpt.tokenizer.encode_chat(format_question(p.question, split.instruction))

    token_ids = [encode(p) for p in split.train]
    eval_prompts = [(p, encode(p)) for p in split.eval] if config.eval.every else []
    state = TrainerState(step=0, policy_version=0, prompt_cursor=0, seed=config.seed, model=config.model.name)
    path = find_checkpoint(config.run_dir)
    if path is not None:
        state = load_trainer_checkpoint(path, model, optimizer)
        if state.seed != config.seed:
            raise TrainerError(f"{path}: saved with seed {state.seed}, but the config has seed={config.seed}; "
                               "resume with the same seed or use another run_dir")
    cycle = PromptCycle(token_ids, split.train, config.seed, state.prompt_cursor, state.untrained)
    return TrainerSetup(model, ckpt.tokenizer, optimizer, cycle, eval_prompts, state, path)
