"""The trainer's thread rule (``actors/trainer/thread_budget.py``): a phase of the step — each
micro-batch's forward and backward, the optimizer step — runs with the generators' threads added
only while they are idle (the trainer is the bottleneck), never while they generate (long responses:
generation is); the share of borrowing phases is counted, and the base count comes back after the step."""

from __future__ import annotations

import torch
from helpers.checkpoints import write_tiny_checkpoint

from specroll.actors.trainer.thread_budget import ThreadBudget, thread_budget
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.sampling import SamplingParams
from specroll.rl.coordinator import Group, Sample
from specroll.rl.grpo_step import build_batch, policy_optimizer, train_step


class _Settings:
    max_staleness, staleness_policy, loss, tis_cap, clip_eps = 1, "mask", "tis", 2.0, 0.2
    max_grad_norm, grad_accum_steps, precision, head_chunk = 1.0, 2, "fp32", 0


def _step(tmp_path, generators_idle: list[bool]) -> tuple[ThreadBudget, list[int]]:
    write_tiny_checkpoint(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    groups = [Group(f"g{g}", [5, 6, 7], [Sample([8 + g, 9], [-1.0, -1.0], [0, 0], "stop"),
                                         Sample([10], [-1.0], [0], "stop")], SamplingParams()) for g in range(2)]
    batch = build_batch(groups, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), normalize_std=True, fill_version=0)
    answers = iter(generators_idle)
    threads: list[int] = []
    torch.set_num_threads(1)
    with thread_budget(1, 1, lambda: next(answers)) as budget:
        def before_phase() -> None:
            budget()
            threads.append(torch.get_num_threads())

        train_step(model, policy_optimizer(model.parameters(), 1e-3, 0.0), batch, 0, _Settings(), before_phase)
    assert torch.get_num_threads() == 1  # the base count after the step
    return budget, threads


def test_phases_borrow_the_generators_threads_only_while_they_are_idle(tmp_path) -> None:
    # phases: forward 1, backward 1, forward 2, backward 2, AdamW; the generator goes idle, gets work, idles again
    budget, threads = _step(tmp_path, [False, True, True, False, True])
    assert threads == [1, 2, 2, 1, 2]
    assert (budget.phases, budget.borrowed, budget.borrowed_fraction) == (5, 3, 0.6)


def test_generation_bound_steps_never_take_the_generators_threads(tmp_path) -> None:
    budget, threads = _step(tmp_path, [False] * 5)  # long responses: the generator never idles
    assert threads == [1] * 5 and budget.borrowed_fraction == 0.0


def test_a_budget_without_threads_to_borrow_reports_none() -> None:
    budget = ThreadBudget(1, 0, lambda: True)
    budget()
    assert torch.get_num_threads() == 1 and budget.borrowed_fraction is None
