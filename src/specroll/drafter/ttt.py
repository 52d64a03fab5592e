"""The maths of training an EAGLE head on a target's rollouts: features, teacher, the training-time-test loss.

For a rollout ``x_0 .. x_{L-1}`` the frozen target gives, at every position t, its taps ``f_t`` and
its next-token distribution ``p_t`` (over ``x_{t+1}``), restricted to the draft vocabulary and
renormalised (EAGLE-3's ``target_p = softmax(target_logits[..., t2d])``). The head is unrolled for
k steps (EAGLE-3's training-time test, arXiv 2503.01840 §3.3):

    step 0, row t:  h⁰_t = head(f_t,       embed(x_{t+1}))   at position t,      predicts x_{t+2} ~ p_{t+1}
    step i, row t:  hⁱ_t = head(hⁱ⁻¹_t,    embed(x_{t+1+i})) at position t + i,  predicts x_{t+2+i} ~ p_{t+1+i}

so step i trains the head on its own features, as it drafts at test time (either architecture of
``eagle_head.py``; an ``eagle3`` head's own LM head is trained with the rest, an ``eagle`` head reads
the target's frozen one); the loss is
``Σ_i 0.8^i · softCE(p_{t+1+i}, q_i(t))`` averaged over rows whose predicted token is a response
token (TLT, arXiv 2511.16665, trains on response tokens only); ``objective="tv"`` puts the total
variation ``½Σ|p − q|`` (one minus a sampled draft's acceptance probability) in place of the soft CE.
There is no hidden-state regression
term (EAGLE-3 has none; TLT's EAGLE-1 heads add a SmoothL1 one). Unlike EAGLE-3, rows whose target
argmax lies outside the draft vocabulary are not masked: the teacher is the renormalised restriction.

Pure and synchronous (no I/O): :class:`specroll.drafter.learner.DrafterLearner` runs these for the
online drafter trainer and, through :func:`specroll.drafter.train.train_drafter`, for the offline
``specroll drafter train``; ``train.py`` also measures a head's acceptance length with them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specroll.drafter.eagle_head import EagleHead
from specroll.engine.model import CausalLM

STEP_WEIGHT = 0.8
"""Weight ratio of successive unrolled steps (EAGLE-3 ``main.py``: ``ploss_weight = 0.8**i``)."""

OBJECTIVES = ("kl", "tv", "kl+tv")
"""The distribution terms :func:`ttt_loss` can train on."""


@torch.no_grad()
def target_features(
    model: CausalLM, token_ids: torch.Tensor, mask: torch.Tensor, feature_layers: Sequence[int],
    draft_to_target: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The target's taps and teacher distributions over right-padded rows, densely and without grad.

    The taps are those :meth:`CausalLM.forward` returns (tap ``i < num_layers``: the residual
    stream entering layer i; tap ``num_layers``: the final normed hidden state), computed with the
    same modules as :meth:`CausalLM.score`.

    Args:
        model: the target.
        token_ids: int64 ``[B, T]`` rows, right-padded.
        mask: bool ``[B, T]``, True at real tokens.
        feature_layers: the head's taps.
        draft_to_target: int64 ``[Vd]`` target ids of the draft vocabulary; ``None``: the taps only.

    Returns:
        features ``[B, T, len(feature_layers)·H]`` (model dtype); float32 teacher log-probabilities
        ``[B, T, Vd]`` of token t + 1 restricted to the draft vocabulary and renormalised; int64
        ``[B, T]`` the target's greedy next token over its full vocabulary (both ``None`` without
        ``draft_to_target``: the LM head is then not run).
    """
    b, t = token_ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    x = model.model.embed_tokens(token_ids)  # [B, T, H]
    cos, sin = model.rotary.cos_sin(positions.flatten(), x.dtype)
    cos, sin = cos.view(b, t, 1, -1), sin.view(b, t, 1, -1)
    idx = torch.arange(t, device=token_ids.device)
    attn_mask = ((idx[None, :] <= idx[:, None]) & mask[:, None, :]) | torch.eye(t, dtype=torch.bool, device=idx.device)
    taps: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        taps[i] = x
        x = layer.forward_dense(x, cos, sin, attn_mask[:, None])
    hidden = model.model.norm(x)  # [B, T, H]
    taps[len(model.model.layers)] = hidden
    features = torch.cat([taps[i] for i in feature_layers], dim=-1)
    if draft_to_target is None:
        return features, None, None
    logits = F.linear(hidden, model.lm_head_weight).float()  # [B, T, V]
    teacher = logits[..., draft_to_target.to(logits.device)].log_softmax(-1)  # [B, T, Vd]
    return features, teacher, logits.argmax(-1)


def shift(x: torch.Tensor, i: int, fill: float | int = 0) -> torch.Tensor:
    """``x[:, t + i]`` at row t (``fill`` past the end): ``[B, T, ...]`` → same shape."""
    if i == 0:
        return x
    pad = torch.full_like(x[:, :i], fill)
    return torch.cat([x[:, i:], pad], dim=1)


def unroll(
    head: EagleHead, target_model: CausalLM, token_ids: torch.Tensor, features: torch.Tensor, steps: int,
    hiddens: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The head's float32 draft logits ``[B, T, Vd]`` of each unrolled step (module docstring):
    row t of step i is the i-th draft from the last verified position t, fed the true tokens.
    ``hiddens``, when given, receives each step's normed head output ``[B, T, H]``."""
    b, t = token_ids.shape
    embed = target_model.model.embed_tokens.weight.detach()
    head_weight = None  # an "eagle3" head drafts through its own (trained) lm_head
    if head.lm_head is None:  # "eagle": the target's LM-head rows of the draft vocabulary, frozen
        head_weight = target_model.lm_head_weight.detach().index_select(0, head.draft_to_target.to(embed.device))
    base = torch.arange(t, device=token_ids.device).expand(b, t)  # [B, T]
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    hidden, out = features, []
    for i in range(steps):
        embeds = F.embedding(shift(token_ids, i + 1), embed)  # [B, T, H]: x_{t+1+i}
        hidden, kv = head.forward_dense(embeds, hidden, base + i, past, from_target=i == 0)
        past.append(kv)
        out.append(head.draft_logits(hidden, head_weight))
        if hiddens is not None:
            hiddens.append(head.norm(hidden))  # [B, T, Vd]
    return out


def response_mask(mask: torch.Tensor, prompt_lens: torch.Tensor, step: int) -> torch.Tensor:
    """bool ``[B, T]``: row t of step ``step`` predicts a response token ``x_{t+2+step}`` that exists
    (its input ``x_{t+1+step}`` and teacher ``p_{t+1+step}`` too)."""
    t = mask.shape[1]
    pos = torch.arange(t, device=mask.device)[None, :] + 2 + step  # [1, T] predicted position
    return shift(mask, step + 2, False) & (pos >= prompt_lens[:, None])


def ttt_loss(
    head: EagleHead, target_model: CausalLM, token_ids: torch.Tensor, mask: torch.Tensor, prompt_lens: torch.Tensor,
    features: torch.Tensor, teacher: torch.Tensor, steps: int = 3, *, final_hidden: torch.Tensor | None = None,
    hidden_weight: float = 0.0, objective: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-3's training-time-test loss (module docstring) over a right-padded batch.

    Args:
        head, target_model: the head being trained and its frozen target.
        token_ids: int64 ``[B, T]``; mask: bool ``[B, T]``; prompt_lens: int64 ``[B]``.
        features, teacher: from :func:`target_features` for these rows.
        steps: unrolled draft steps k.
        final_hidden: ``[B, T, H]`` the target's final normed hidden states (tap ``num_layers``);
            needed when ``hidden_weight > 0``.
        hidden_weight: weight of the optional hidden-state regression: SmoothL1 between step i's
            normed output and the target's final hidden state at ``t + 1 + i`` (the state whose LM
            head gives ``p_{t+1+i}``), as TLT's EAGLE heads add it (``0.5·SmoothL1 + 0.5·softCE``);
            0 (EAGLE-3) leaves it out.
        objective: what each step's distribution term is: ``"kl"`` the soft cross-entropy
            ``−Σ p log q`` (KL(p ‖ q) plus the teacher's entropy; EAGLE-3's loss); ``"tv"`` the total
            variation ``½ Σ |p − q|``, which is exactly one minus the probability that a draft
            sampled from q is accepted against p (Leviathan et al. 2023, arXiv 2211.17192 §3.5;
            DistillSpec, Zhou et al. 2024, arXiv 2310.08461 §4 trains drafters on it); ``"kl+tv"``
            their sum (KL's gradient everywhere, TV's aim at acceptance).

    Returns:
        The scalar loss (``Σ_i 0.8^i · (mean objective term + hidden_weight · mean SmoothL1) of step i``),
        and metrics ``loss``, ``ce_i``, ``kl_i`` (``ce_i`` less the teacher's entropy: KL(p ‖ q), 0
        at a perfect head), ``top1_i`` (the head's argmax equals the teacher's on step i's rows: an
        acceptance proxy), ``tv_i`` (``1 − tv_i`` is step i's acceptance probability of a sampled
        draft against the teacher) and, with the regression, ``hidden_i``.

    Raises:
        ValueError: ``hidden_weight > 0`` without ``final_hidden``, or an unknown ``objective``.
    """
    if hidden_weight > 0 and final_hidden is None:
        raise ValueError("ttt_loss: hidden_weight > 0 needs final_hidden")
    if objective not in OBJECTIVES:
        raise ValueError(f"ttt_loss: objective={objective!r}, expected one of {', '.join(OBJECTIVES)}")
    hiddens: list[torch.Tensor] = []
    logits = unroll(head, target_model, token_ids, features, steps, hiddens if hidden_weight > 0 else None)
    loss = torch.zeros((), device=token_ids.device)
    metrics: dict[str, float] = {}
    for i, q in enumerate(logits):
        rows = response_mask(mask, prompt_lens, i)  # [B, T]
        p = shift(teacher, i + 1)  # [B, T, Vd] teacher p_{t+1+i}
        log_q = q.log_softmax(-1)  # [B, T, Vd]
        ce = -(p.exp() * log_q).sum(-1)  # [B, T]
        tv = 0.5 * (p.exp() - log_q.exp()).abs().sum(-1)  # [B, T]
        n = rows.sum().clamp(min=1)
        ce_i = (ce * rows).sum() / n
        tv_i = (tv * rows).sum() / n
        term = {"kl": ce_i, "tv": tv_i, "kl+tv": ce_i + tv_i}[objective]
        loss = loss + STEP_WEIGHT**i * term
        if hidden_weight > 0:
            assert final_hidden is not None
            want = shift(final_hidden, i + 1).to(hiddens[i].dtype)  # [B, T, H]
            reg = F.smooth_l1_loss(hiddens[i], want, reduction="none").mean(-1)  # [B, T]
            hidden_i = (reg * rows).sum() / n
            loss = loss + STEP_WEIGHT**i * hidden_weight * hidden_i
            metrics[f"hidden_{i}"] = hidden_i.item()
        metrics[f"ce_{i}"] = ce_i.item()
        metrics[f"tv_{i}"] = tv_i.item()
        entropy = -(p.exp() * p).sum(-1)  # [B, T]: the CE floor, so ce − entropy = KL(p ‖ q)
        metrics[f"kl_{i}"] = ce_i.item() - ((entropy * rows).sum() / n).item()
        metrics[f"top1_{i}"] = (((q.argmax(-1) == p.argmax(-1)) & rows).sum() / n).item()
    metrics["loss"] = loss.item()
    return loss, metrics


@dataclass(frozen=True)
class Rollout:
    """One finished rollout: prompt and response token ids, concatenated."""

    token_ids: list[int]
    prompt_len: int
    policy_version: int = 0


def window_start(rollout: Rollout, window: int, rng: random.Random | None = None) -> int:
    """Where a window of at most ``window`` tokens of ``rollout`` starts: 0 for a rollout that fits,
    else a random point (deterministic ``rng``; the earliest without one) at or before its response,
    so that the window ends in the response."""
    if len(rollout.token_ids) <= window:
        return 0
    hi = len(rollout.token_ids) - window
    lo = min(max(0, rollout.prompt_len - 2), hi)
    return rng.randint(lo, hi) if rng is not None else lo


def make_batch(rollouts: Sequence[Rollout], window: int, rng: random.Random | None = None,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded windows (:func:`window_start`) of ``rollouts``; a window's prompt length is
    counted from its start. Returns int64 ``token_ids [B, W]``, bool ``mask [B, W]``, int64
    ``prompt_lens [B]``.
    """
    rows, lens = [], []
    for r in rollouts:
        start = window_start(r, window, rng)
        rows.append(r.token_ids[start : start + window])
        lens.append(max(0, r.prompt_len - start))
    w = max(len(r) for r in rows)
    token_ids = torch.zeros(len(rows), w, dtype=torch.long)
    mask = torch.zeros(len(rows), w, dtype=torch.bool)
    for b, r in enumerate(rows):
        token_ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, : len(r)] = True
    return token_ids.to(device), mask.to(device), torch.tensor(lens, dtype=torch.long, device=device)
