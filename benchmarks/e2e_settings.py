"""The common settings of the end-to-end benchmark (``bench_e2e.py``) and the run config each arm gets.

Every arm trains the same GRPO work: the specroll arms through ``specroll launch`` on the example
config with ``--set`` overrides, the TRL arm from the *same* resolved :class:`RunConfig` (its
learning rate, AdamW, gradient clipping, advantage normalisation, sampling, task and precision), so a setting
can only differ between arms where this module says so. Imports no torch (the config loader does not).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from specroll.actors.config import RunConfig, load_config

Arm = Literal["trl", "sync", "specroll"]
ARMS: tuple[Arm, ...] = ("trl", "sync", "specroll")
Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
ENGINE_DTYPE: dict[Precision, str] = {"fp32": "float32", "bf16": "bfloat16"}
"""The specroll generators' ``generator.engine.dtype`` at each precision (also the TRL arm's evaluation engine's)."""
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gsm8k_smollm2.toml"
"""The example run the specroll arms launch; the defaults of the common settings are its values."""

TINY_RUN_SETS = (
    # What tests/helpers/launch.py writes for runs on a tiny random-weight checkpoint: one generator, a
    # small KV cache, fast heartbeats, and a drafter small enough for a 320-token vocabulary. (Not the
    # engine's dtype: --precision sets it, for the tiny checkpoint as for the real one.)
    "generator.count=1",
    "generator.heartbeat_s=0.5",
    "generator.engine.kv_cache_memory_gb=0.02",
    "generator.engine.max_num_seqs=8",
    "drafter.min_rollouts=2",
    "drafter.publish_every_steps=2",
    "drafter.window_tokens=16",
    "drafter.draft_vocab_size=64",
    "drafter.duty_cycle=1.0",
)
QUICK = {"steps": 2, "seeds": [0], "max_tokens": 16, "eval_every": 1, "eval_count": 8, "group": 2, "prompts": 2}
"""``--quick``: a smoke run for CI (with ``--model`` a tiny checkpoint directory)."""


@dataclass(frozen=True)
class Settings:
    """What every arm shares (the CLI's flags, resolved)."""

    model: str
    """Registered model name, Hugging Face checkpoint directory or ``.gguf`` file."""
    seeds: list[int]
    steps: int
    """GRPO steps N (one optimizer step each)."""
    arms: list[Arm]
    group: int
    """Samples per prompt (a GRPO group)."""
    prompts: int
    """Prompts (groups) per step: a step trains on ``prompts * group`` samples."""
    learning_rate: float
    max_tokens: int
    """Most new tokens per sample."""
    eval_every: int
    """Steps between evaluations; besides, before training and after the last step (0 disables evaluation)."""
    eval_count: int
    """Held-out evaluation prompts."""
    target_accuracy: float
    """Evaluation accuracy whose first crossing is timed."""
    trl_threads: int
    """Torch CPU threads of the TRL arm."""
    arm_timeout_s: float
    """Longest a single arm may run, in seconds."""
    quick: bool = False
    precision: Precision = "bf16"
    """Arithmetic of every arm (:func:`precision_sets`; TRL: ``GRPOConfig(bf16=...)``)."""
    extra_sets: list[str] = field(default_factory=list)
    """Further ``--set`` overrides for the specroll arms (and the TRL arm's evaluation engine)."""

    @property
    def samples_per_step(self) -> int:
        return self.prompts * self.group

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def example_defaults(example: Path = EXAMPLE) -> dict[str, float | int]:
    """The defaults of the common settings: the example config's ``[trainer]``, ``[generator.sampling]``
    and ``[eval]`` values (so the benchmark trains what ``specroll launch`` on the example trains).

    Raises:
        ConfigError: the example does not load.
    """
    c = load_config(example)
    return {"group": c.trainer.group_size, "prompts": c.trainer.batch_groups,
            "learning_rate": c.trainer.learning_rate, "max_tokens": c.generator.sampling.max_tokens,
            "eval_every": c.eval.every, "eval_count": c.eval.count}


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string of printable text is a TOML basic string


def precision_sets(precision: Precision) -> list[str]:
    """The specroll arms' overrides for ``precision``: the trainer's ``trainer.precision`` (``bf16``:
    autocast to bfloat16 over float32 master weights and AdamW state, as TRL's ``bf16=True``) and the
    generators' engine dtype (:data:`ENGINE_DTYPE`: TRL generates with its training model, so at the
    same precision; ``auto`` would pick bfloat16 on a CPU with native bf16 even at ``fp32``).

    Raises:
        ValueError: ``precision`` is not one of :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
    return [f"trainer.precision={_toml_string(precision)}",
            f"generator.engine.dtype={_toml_string(ENGINE_DTYPE[precision])}"]


def run_sets(s: Settings, seed: int, run_dir: Path, arm: Arm, example: Path = EXAMPLE) -> list[str]:
    """The ``--set`` overrides of one specroll run (``arm`` ``sync`` or ``specroll``; ``trl`` reads the
    ``sync`` ones). ``trainer.max_groups_in_flight`` is raised to ``prompts`` when the example's is lower;
    ``s.extra_sets`` come last (:func:`check_comparable` refuses those that would undo the precision)."""
    base = load_config(example)
    sets = [f"run_dir={_toml_string(str(run_dir))}", f"seed={seed}", f"steps={s.steps}",
            f"model.name={_toml_string(s.model)}", f"trainer.batch_groups={s.prompts}",
            f"trainer.group_size={s.group}", f"trainer.learning_rate={s.learning_rate!r}",
            f"generator.sampling.max_tokens={s.max_tokens}", f"eval.every={s.eval_every}",
            f"eval.count={s.eval_count}",
            f"trainer.max_groups_in_flight={max(base.trainer.max_groups_in_flight, s.prompts)}",
            # No drafter warm start: a one-time cost (cached after it) that no other arm has, outside
            # what this benchmark compares (training the policy); the drafter trainer still runs online.
            "drafter.warm_start_minutes=0"]
    if arm != "specroll":
        sets.append('trainer.mode="sync"')
    if s.quick:
        sets += TINY_RUN_SETS
    return sets + precision_sets(s.precision) + list(s.extra_sets)


def resolved_config(s: Settings, seed: int, run_dir: Path, arm: Arm, example: Path = EXAMPLE) -> RunConfig:
    """The run config ``specroll launch`` resolves for this arm (what the launcher validates first).

    Raises:
        ConfigError: an override is malformed or out of range; the message names the key.
    """
    return load_config(example, run_sets(s, seed, run_dir, arm, example))


def check_comparable(c: RunConfig, precision: Precision) -> None:
    """Refuse settings under which TRL's GRPOTrainer and specroll would not train the same objective at
    the same ``precision``.

    TRL is run with ``beta=0`` (no KL), one update per batch (importance ratio 1), the DAPO token mean
    over the whole batch, group std-normalised (or centred-only) advantages and AdamW at a constant
    LR; specroll's ``tis``/``ppo`` losses reduce to the same policy gradient on lag-0 tokens (its
    ``grad_accum_steps`` micro-batches share one token mean over the step, so they give the gradient
    of the whole batch, as TRL's single one does). TRL trains float32 parameters, under bfloat16
    autocast at ``bf16``, and generates with that same model; so specroll's parameters must be float32,
    its ``trainer.precision`` the benchmark's and its generators' engine dtype
    ``ENGINE_DTYPE[precision]`` (the TRL arm's evaluation engine is configured as they are).

    Raises:
        ValueError: a setting TRL's arm cannot mirror (names it).
    """
    if c.model.dtype != "float32":
        raise ValueError(f"model.dtype={c.model.dtype!r}; TRL trains float32 parameters (expected 'float32')")
    if c.trainer.precision != precision:
        raise ValueError(f"trainer.precision={c.trainer.precision!r} but --precision {precision}: TRL's arm "
                         f"trains at --precision (set that instead)")
    if c.generator.engine.dtype != ENGINE_DTYPE[precision]:
        raise ValueError(f"generator.engine.dtype={c.generator.engine.dtype!r} but --precision {precision}: TRL "
                         f"generates at --precision (expected {ENGINE_DTYPE[precision]!r}; set --precision instead)")
    if c.task.prompts is not None:
        raise ValueError(f"task.prompts={c.task.prompts!r}; the TRL arm uses the built-in task (expected unset)")
    if c.eval.prompts is not None or c.eval.greedy:
        raise ValueError("eval.prompts and eval.greedy must stay unset: every arm is evaluated the same way")
