"""Token sampling with behavior logprobs: temperature → top-k → top-p, per-request seeds.

The processed distribution of a request is ``softmax(logits / T)`` restricted to its ``top_k``
most likely tokens, then to the smallest prefix of those (by probability) whose mass reaches
``top_p``, renormalised — the order and semantics of Hugging Face's ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper``. Every token is drawn from that distribution and its
logprob is taken under it (the behavior logprob an off-policy RL loss needs).

Sampling inverts the CDF: one uniform ``u`` per row from the request's own ``torch.Generator``,
and the token is the first whose cumulative probability (float64) exceeds ``u · total`` — an exact
draw that costs one random number per row instead of one per vocabulary entry, and gives a seeded
request the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specroll.protocol.sampling import SamplingParams


def processed_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Log-probabilities of each row's processed distribution.

    Args:
        logits: float32 ``[B, V]`` raw logits (any device).
        params: one :class:`SamplingParams` per row. Greedy rows (temperature 0) use T = 1 and no
            filters: their logprob is the model's own ``log_softmax`` at the argmax.

    Returns:
        float32 ``[B, V]``; ``-inf`` for tokens the filters removed.
    """
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype,
                         device=logits.device)
    scaled = logits / temps[:, None]  # [B, V]
    top_ks = [p.top_k if p.temperature > 0 else 0 for p in params]
    top_ps = [p.top_p if p.temperature > 0 else 1.0 for p in params]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        scaled = _filter_top_k_top_p(scaled, top_ks, top_ps)
    return torch.log_softmax(scaled, dim=-1)


def _filter_top_k_top_p(scaled: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    device = scaled.device
    rank = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))  # top-k: keep ranks < k
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    p = torch.tensor(top_ps, dtype=scaled.dtype, device=device)[:, None]
    # top-p: keep token i while the mass before it is < p (so the kept mass first reaches p at i);
    # the most likely token is always kept, and rows with p = 1 are left alone (float rounding
    # can make the running sum reach 1 before the tail ends).
    drop = (mass_before >= p) & (rank > 0) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def draw_inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalised non-negative ``weights`` (float64 ``[B, V]``).

    Returns int64 ``[B]``: the first index whose cumulative weight exceeds ``uniform · total``,
    ``uniform`` float64 ``[B]`` in [0, 1).
    """
    cdf = weights.cumsum(dim=-1)  # [B, V]
    drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return drawn.clamp_(max=weights.shape[-1] - 1)  # guards uniform * total == total in rounding


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and its behavior logprob.

    Args:
        logits: float32 ``[B, V]`` raw logits.
        params: one :class:`SamplingParams` per row.
        generators: one generator per row (``None`` only for greedy rows).

    Returns:
        ``(tokens, logprobs)``: int64 ``[B]`` and float32 ``[B]`` (natural log, under the
        processed distribution; see :func:`processed_logprobs`).
    """
    logprobs = processed_logprobs(logits, params)  # [B, V]
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    # exp in float32 (relative error ~1e-7), the CDF in float64: as the verifier draws (spec/verify.py)
    if sampled and len(sampled) == len(params):  # the rollout case: no greedy row, no row selection
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])  # [B]
        tokens = draw_inverse_cdf(logprobs.exp().double(), u)
    else:
        tokens = logprobs.argmax(dim=-1)  # greedy rows keep the argmax
        if sampled:
            u = torch.cat([torch.rand(1, dtype=torch.float64, generator=generators[i]) for i in sampled])  # [S]
            tokens[sampled] = draw_inverse_cdf(logprobs[sampled].exp().double(), u)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
