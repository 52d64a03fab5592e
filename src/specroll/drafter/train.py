"""Training an EAGLE head on a fixed set of rollouts, and measuring how often its drafts would be accepted.

:func:`train_drafter` runs the online drafter trainer's own steps (:class:`~specroll.drafter.learner.DrafterLearner`)
over saved rollouts, for the offline ``specroll drafter train``; the features, the training-time-test loss and
the rollout windows are in ``ttt.py`` (shared with the learner). :func:`expected_acceptance_length` measures a
head against the target without the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.learner import DrafterLearner, LearnerConfig
from specroll.drafter.ttt import Rollout, make_batch, response_mask, shift, target_features, unroll
from specroll.engine.model import CausalLM


def train_drafter(
    head: EagleHead, target_model: CausalLM, rollouts: Sequence[Rollout], *, steps: int,
    lr: float = 1e-3, batch: int = 8, window: int = 256, ttt_steps: int = 3, seed: int = 0,
    weight_decay: float = 0.0, log_every: int = 1, objective: str = "kl",
) -> list[dict[str, float]]:
    """Train ``head`` in place for ``steps`` AdamW steps on windows of ``rollouts``: the online
    drafter trainer's own loop (:class:`specroll.drafter.learner.DrafterLearner`) over a fixed set.

    The target is frozen; its features are computed once per rollout (whole rollout, up to
    ``max(1024, window)`` tokens) and teachers come from its current LM head.

    Returns:
        The metrics of every ``log_every``-th step and of the last (:func:`ttt_loss`'s, plus ``step``).

    Raises:
        ValueError: no rollouts, or a setting out of range.
        DrafterError: ``head`` was made for another target.
    """
    if not rollouts:
        raise ValueError("train_drafter: no rollouts to train on")
    config = LearnerConfig(lr=lr, weight_decay=weight_decay, batch=batch, window=window, ttt_steps=ttt_steps,
                           buffer_rollouts=len(rollouts), min_rollouts=1, max_context=max(1024, window), seed=seed,
                           objective=objective)
    learner = DrafterLearner(target_model, config, head=head)
    for r in rollouts:
        learner.add_rollout(r.token_ids, r.prompt_len, r.policy_version)
    history = []
    for step in range(steps):
        metrics = learner.step()
        if step % log_every == 0 or step == steps - 1:
            history.append({**metrics, "step": float(step)})
    return history


@torch.no_grad()
def expected_acceptance_length(head: EagleHead, target_model: CausalLM, rollouts: Sequence[Rollout],
                               k: int) -> float:
    """Mean tokens emitted per verification step (1 + accepted drafts, at most k + 1) of greedy
    chain drafting under greedy verification, from every last-verified position in the responses.

    Measured without the engine, exactly: from the verified prefix ``x_{≤t+1}`` the head drafts
    ``d_1..d_k`` greedily and the target accepts ``d_j`` while ``d_1..d_j`` equal the target's greedy
    continuation ``g_1..g_j``. Along the rollout, ``g_j`` is the target's argmax after ``x_{≤t+j}``,
    which equals ``x_{t+1+j}`` wherever the rollout follows the target's greedy choice; there the
    drafts are fed the same tokens as in :func:`unroll`. So draft j counts as accepted when, for
    all j' ≤ j, the head's argmax equals ``x_{t+1+j'}`` *and* the target's argmax does too. Exact
    on the target's greedy rollouts, except that drafts past the rollout's end are not counted; on
    sampled rollouts it undercounts (stops where the rollout leaves the greedy path). Every position
    whose step 0 predicts a response token counts once, whereas the engine drafts only from the
    positions it stops at, so its ``spec_stats.acceptance_length`` differs somewhat.
    """
    head.eval()
    buffer = list(rollouts)
    total, count = 0.0, 0
    for i in range(0, len(buffer), 8):
        token_ids, mask, prompt_lens = make_batch(buffer[i : i + 8], window=1 << 30,
                                                  device=target_model.lm_head_weight.device)
        features, _, greedy = target_features(target_model, token_ids, mask, head.config.feature_layers,
                                              head.draft_to_target)
        logits = unroll(head, target_model, token_ids, features, k)
        d2t = head.draft_to_target.to(token_ids.device)
        alive = response_mask(mask, prompt_lens, 0)  # [B, T] rows that draft
        rows = alive.clone()
        accepted = torch.zeros_like(token_ids)
        for j, q in enumerate(logits):
            nxt = shift(token_ids, j + 2)  # x_{t+2+j}: the draft j's slot
            alive = alive & response_mask(mask, prompt_lens, j) & (d2t[q.argmax(-1)] == nxt)
            alive = alive & (shift(greedy, j + 1) == nxt)  # the target's greedy choice there
            accepted += alive.long()
        total += float((accepted + 1)[rows].sum())
        count += int(rows.sum())
    return total / max(count, 1)
