"""bench_drafter.py's policy shift: fine-tune the policy on GSM8K reference solutions, then measure
the drafter's drop and its recovery over new drafter versions."""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from drafter_online import OnlineDrafter, Round, Version, fmt_acceptance

from specroll.rl.tasks import PromptFileError, format_question

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    import torch

    from specroll.engine.loaders.checkpoint import Checkpoint

RECOVERY_FRACTION = 0.9
"""Acceptance counts as recovered at this fraction of its pre-update value."""


def reference_solutions(path: Path, count: int) -> list[tuple[str, str]]:
    """``(question, answer)`` of the last ``count`` lines of a GSM8K file, last first: the full
    reference solution, which :func:`load_prompts` cuts down to the final number.

    Raises:
        PromptFileError: a line is not JSON or lacks a non-empty string ``question`` or ``answer``.
    """
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    pairs = []
    for n, line in reversed(lines[-count:]):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        question, answer = (row.get(key) if isinstance(row, dict) else None for key in ("question", "answer"))
        if not (isinstance(question, str) and question and isinstance(answer, str) and answer):
            raise PromptFileError(f"{path}:{n}: expected non-empty string 'question' and 'answer' (a reference "
                                  "solution to fine-tune the policy on)")
        pairs.append((question, answer))
    return pairs


def fine_tune_policy(checkpoint: Checkpoint, examples: list[tuple[list[int], int]], steps: int, batch: int,
                     lr: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Supervised fine-tuning of a float32 copy of the policy on ``(token ids, prompt length)``
    examples: mean cross-entropy of the tokens after the prompt, AdamW, gradients clipped at 1.

    Returns:
        The new weights under Hugging Face names (copies), and the loss of each step.
    """
    import torch
    import torch.nn.functional as F

    from specroll.engine.model import CausalLM

    model = CausalLM(checkpoint.config)
    model.load_weights(checkpoint.weights)
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        part = [examples[(step * batch + i) % len(examples)] for i in range(batch)]
        width = max(len(ids) for ids, _ in part)
        ids = torch.zeros(batch, width, dtype=torch.long)  # [B, T]
        mask = torch.zeros(batch, width, dtype=torch.bool)  # [B, T]
        learn = torch.zeros(batch, width - 1, dtype=torch.bool)  # [B, T-1]: position t predicts a solution token
        for b, (row, prompt_len) in enumerate(part):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = True
            learn[b, prompt_len - 1 : len(row) - 1] = True
        logits = model.score(ids, mask)[:, :-1]  # [B, T-1, V]
        ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(learn)
        loss = (ce * learn).sum() / learn.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        print(f"  fine-tuning step {step + 1}/{steps}: loss {losses[-1]:.3f}", flush=True)
    return {name: t.clone() for name, t in model.hf_weights().items()}, losses


@dataclass
class Shift:
    sft_losses: list[float]
    sft_seconds: float
    before: Round
    """The last drafter on the old policy."""
    after: Round
    """The same drafter and prompts on the new policy: the drop."""
    curve: list[Version]
    """New versions trained on new-policy rollouts, each measured on a fresh round."""
    learner_seconds: float
    recovery_versions: int | None

    def as_json(self) -> dict[str, object]:
        before, after = self.before.acceptance_length, self.after.acceptance_length
        return {"acceptance_before": before, "acceptance_after": after,
                "threshold": RECOVERY_FRACTION * before if before is not None else None,
                "curve": [v.as_json() for v in self.curve],
                "recovery_versions": self.recovery_versions, "sft_losses": self.sft_losses,
                "sft_seconds": self.sft_seconds, "learner_seconds": self.learner_seconds,
                "before": asdict(self.before), "after": asdict(self.after)}


def shift_and_recover(online: OnlineDrafter, checkpoint: Checkpoint, args: argparse.Namespace) -> Shift:
    """Phase 3 (bench_drafter's docstring)."""
    first = online.next_prompts()
    before = online.generate(first, "before", feed=False)
    print(f"  last drafter v{online.learner.version} on policy 0: acceptance "
          f"{fmt_acceptance(before.acceptance_length)}", flush=True)
    tokenizer = checkpoint.tokenizer
    examples = []
    for question, answer in args.solutions:
        prompt = tokenizer.encode_chat(format_question(question))
        examples.append((prompt + tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_ids[0]],
                         len(prompt)))
    start = time.perf_counter()
    weights, losses = fine_tune_policy(checkpoint, examples, args.sft_steps, args.sft_batch, args.sft_lr)
    sft_seconds = time.perf_counter() - start
    online.engine.update_weights(weights, 1)
    online.learner.set_policy(weights, 1)
    del weights
    gc.collect()
    after = online.generate(first, "after")
    print(f"  same drafter on policy 1: acceptance {fmt_acceptance(after.acceptance_length)}", flush=True)
    threshold = RECOVERY_FRACTION * (before.acceptance_length or 1.0)
    curve: list[Version] = []
    phase_start = online.learner_seconds
    recovered = None
    for i in range(1, args.recovery_versions_max + 1):
        v = online.next_version("shift", phase_start, args.steps_per_version, f"s{i}")
        curve.append(v)
        if (v.round.acceptance_length or 1.0) >= threshold:
            recovered = i
            break
    return Shift(losses, sft_seconds, before, after, curve, online.learner_seconds - phase_start, recovered)


