"""``bench_drafter_curve.py``'s offline measure of a head on held-out rollouts: teacher forced,
batched, no engine.

Each held-out rollout is unrolled as training unrolls it (:func:`specroll.drafter.ttt.unroll`):
row t of step i is draft position i + 1 from the last verified position t, fed the rollout's true
tokens, and is compared with the target's distribution p of that token over its **whole**
vocabulary at T = 1 (tokens outside the head's draft vocabulary keep their mass; the head gives
them q = 0). Per draft position, averaged over the rows that predict a response token:

- ``accept_prob``: ``1 − TV(p, q) = Σ_v min(p_v, q_v)``, the probability that a draft sampled from
  q is accepted against p (Leviathan et al. 2023, arXiv 2211.17192 §3.5; Chen et al. 2023);
- ``kl``: KL(p̂ ‖ q), p̂ being p restricted to the draft vocabulary and renormalised (the
  distribution the training loss targets); KL(p ‖ q) itself is infinite whenever p has mass
  outside the draft vocabulary, so that mass is given apart as ``outside_mass`` (0 for a
  full-vocabulary head, whose ``kl`` is then the full KL(p ‖ q));
- ``top1``: the head's argmax equals the target's (full-vocabulary) argmax.

``est_acceptance[k − 1]``, the estimated acceptance length of a sampled chain of k drafts, is the
mean over response positions of ``1 + Σ_{j=1..k} Π_{i≤j} (1 − TV_i)``: the expected tokens per
verification step if draft i were accepted with probability ``1 − TV_i`` given the ones before.
It is a teacher-forced estimate: draft i + 1 is fed the rollout's token rather than draft i, which
after an acceptance is distributed as ``min(p, q)`` normalised, not as p; and a chain that runs
past the rollout's end stops there. ``target_entropy`` (nats) and ``target_top1_mass`` (mean
``max_v p_v``) describe p itself, the reference for how much any head can match.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from specroll.drafter.eagle_head import EagleHead
    from specroll.drafter.ttt import Rollout
    from specroll.engine.model import CausalLM

BATCH = 4
"""Held-out rollouts per batch: full-vocabulary p of 4 rollouts of ~400 tokens is ~0.3 GB in float32."""


@dataclass
class HeldOutBatch:
    """Held-out rollouts with what the target gives them, computed once for every head measured."""

    token_ids: torch.Tensor
    """int64 ``[B, T]``, right-padded."""
    mask: torch.Tensor
    """bool ``[B, T]``."""
    prompt_lens: torch.Tensor
    """int64 ``[B]``."""
    features: torch.Tensor
    """bfloat16 ``[B, T, n_taps·H]``: the taps, rounded as the learner caches them."""
    final: torch.Tensor
    """``[B, T, H]``: the target's final normed hidden states (its logits are ``final @ W_lm^T``)."""
    entropy: torch.Tensor
    """float32 ``[B, T]``: H(p_t) in nats, p_t the target's T = 1 distribution over x_{t+1}."""
    top1_mass: torch.Tensor
    """float32 ``[B, T]``: ``max_v p_t(v)``."""
    argmax: torch.Tensor
    """int64 ``[B, T]``: the target's most likely x_{t+1} over its whole vocabulary."""
    taps: tuple[int, ...]
    """The target layers of ``features`` (a head must read these)."""
    _draft_logp: dict[bytes, torch.Tensor] = field(default_factory=dict)

    def logp(self, weight: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, T, V]``: log p_t over the whole vocabulary (recomputed: ~0.2 GB a batch)."""
        return _logp(self.final, weight)

    def draft_logp(self, weight: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, T, Vd]``: log p_t of the draft vocabulary ``d2t``'s tokens (not renormalised),
        kept per vocabulary smaller than the target's (heads of one vocabulary share it)."""
        if d2t.numel() == weight.shape[0]:
            return self.logp(weight)[..., d2t]
        key = d2t.cpu().numpy().tobytes()
        if key not in self._draft_logp:
            self._draft_logp[key] = self.logp(weight)[..., d2t]
        return self._draft_logp[key]


def held_out_batches(target: CausalLM, rollouts: list[Rollout], feature_layers: tuple[int, ...]) -> list[HeldOutBatch]:
    """The target's taps, final hidden states and own statistics on ``rollouts``, in batches of :data:`BATCH`."""
    import torch

    from specroll.drafter.ttt import make_batch, target_features

    device = target.lm_head_weight.device
    weight = target.lm_head_weight.detach()
    h = target.config.hidden_size
    batches = []
    with torch.no_grad():
        for i in range(0, len(rollouts), BATCH):
            token_ids, mask, prompt_lens = make_batch(rollouts[i : i + BATCH], window=1 << 30, device=device)
            taps, _, _ = target_features(target, token_ids, mask, (*feature_layers, target.config.num_layers), None)
            final = taps[..., -h:]
            logp = _logp(final, weight)  # [B, T, V]
            top = logp.max(-1)
            batches.append(HeldOutBatch(token_ids, mask, prompt_lens, taps[..., :-h].to(torch.bfloat16), final,
                                        -(logp.exp() * logp).sum(-1), top.values.exp(), top.indices,
                                        tuple(feature_layers)))
    return batches


def _logp(final: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax of the target's logits ``final @ weight^T`` (T = 1)."""
    import torch.nn.functional as F

    return F.linear(final.to(weight.dtype), weight).float().log_softmax(-1)


@dataclass(frozen=True)
class PositionMetrics:
    """One draft position, averaged over its rows (module docstring)."""

    accept_prob: float
    kl: float
    outside_mass: float
    top1: float
    rows: int


@dataclass(frozen=True)
class Offline:
    """A head's offline measure (module docstring)."""

    positions: list[PositionMetrics]
    """Draft positions 1..k."""
    est_acceptance: list[float]
    """Estimated acceptance length of a sampled chain of k = 1..len drafts."""
    target_entropy: float
    target_top1_mass: float
    rows: int
    """Response positions counted (position 1's rows)."""

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def offline_metrics(head: EagleHead, target: CausalLM, batches: list[HeldOutBatch], k: int) -> Offline:
    """``head`` against the target on ``batches`` for draft positions 1..``k`` (module docstring)."""
    import torch

    from specroll.drafter.ttt import response_mask, shift, unroll

    weight = target.lm_head_weight.detach()
    d2t = head.draft_to_target.to(weight.device)  # [Vd] target id of each draft column
    sums = torch.zeros(k, 5, dtype=torch.float64)  # per position: accept, kl, outside, top1, rows
    chain = torch.zeros(k, dtype=torch.float64)  # Σ over rows of Π_{i≤j} (1 − TV_i)
    entropy = top1_mass = rows0 = 0.0
    was_training = head.training
    head.eval()
    with torch.no_grad():
        for b in batches:
            features = b.features.to(weight.dtype)
            logp_draft = b.draft_logp(weight, d2t)  # [B, T, Vd]: log p_t of the draft tokens, over x_{t+1}
            first = response_mask(b.mask, b.prompt_lens, 0)  # [B, T] rows drafting position 1
            alive = first.double()
            for i, q in enumerate(unroll(head, target, b.token_ids, features, k)):
                rows = response_mask(b.mask, b.prompt_lens, i)  # [B, T]
                lp_draft = shift(logp_draft, i + 1)  # [B, T, Vd] target log p over x_{t+2+i}
                p_draft = lp_draft.exp()
                inside = p_draft.sum(-1).clamp(1e-30, 1.0)  # [B, T] p's mass on the draft vocabulary
                log_q = q.log_softmax(-1)  # [B, T, Vd]
                # TV(p, q) = ½ (Σ_{v∈D} |p_v − q_v| + p(V∖D)), q being 0 off the draft vocabulary
                tv = 0.5 * ((p_draft - log_q.exp()).abs().sum(-1) + (1 - inside))
                # KL(p̂ ‖ q) with p̂ = p_D / p(D): Σ p̂ (log p_D − log p(D) − log q)
                kl = (p_draft * (lp_draft - log_q)).sum(-1) / inside - inside.log()
                top1 = d2t[q.argmax(-1)] == shift(b.argmax, i + 1)
                w = rows.double()
                sums[i] += torch.stack([((1 - tv) * w).sum(), (kl * w).sum(), ((1 - inside) * w).sum(),
                                        (top1 * w).sum(), w.sum()]).double()
                alive = alive * (1 - tv).double() * w  # 0 once the chain passes the rollout's end
                chain[i] += alive.sum()
                if i == 0:
                    f = first.double()
                    entropy += float((shift(b.entropy, 1) * f).sum())
                    top1_mass += float((shift(b.top1_mass, 1) * f).sum())
                    rows0 += float(f.sum())
    head.train(was_training)
    n = max(rows0, 1.0)
    positions = [PositionMetrics(float(s[0] / max(s[4], 1)), float(s[1] / max(s[4], 1)), float(s[2] / max(s[4], 1)),
                                 float(s[3] / max(s[4], 1)), int(s[4])) for s in sums]
    est = [1 + float(chain[: j + 1].sum()) / n for j in range(k)]
    return Offline(positions, est, entropy / n, top1_mass / n, int(rows0))
