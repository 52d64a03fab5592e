"""Verify: turn the target's logits over ``[last, d1..dk]`` into emitted tokens, with behavior
logprobs, through chain rejection sampling.

The engine appends each decoding sequence's drafts to its step input, so one target forward
scores every draft; :func:`verify_drafts` takes the processed distributions (temperature → top-k →
top-p) of those rows and verifies them with :func:`chain_rejection_sample`, using uniforms drawn
from each request's own generator.

Chain speculative sampling. For draft position i with target distribution p_i and draft
distribution q_i (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023):

- accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), i.e. when ``u_i · q_i(d_i) < p_i(d_i)``;
- at the first rejection j, emit a token drawn from ``norm(max(0, p_j − q_j))`` and stop;
- if all k drafts pass, emit a bonus token drawn from p_k.

Every emitted token is then distributed exactly as if drawn from p. A proposer without
probabilities (n-gram, greedy drafter) has a one-hot q: d_i is accepted with probability p_i(d_i)
and the recovery distribution is p_i with d_i removed. Greedy rows accept d_i iff it is the argmax
of p_i and emit the argmax at the first mismatch (or as the bonus). The same semantics as vLLM v1's
``rejection_sampler.py`` and FlashInfer's ``chain_speculative_sampling``.

:func:`chain_rejection_sample` is pure and vectorised: the caller supplies the uniform random
numbers (drawn from each request's own generator), so results never depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from specroll.engine.sampler import draw_inverse_cdf, processed_logprobs
from specroll.engine.sequence import Sequence


@dataclass(frozen=True)
class VerifyResult:
    token_ids: torch.Tensor
    """int64 ``[B, K+1]``: accepted drafts, then the recovered or bonus token, then -1 padding."""
    num_accepted: torch.Tensor
    """int64 ``[B]``: drafts accepted per row; each row emits ``num_accepted + 1`` tokens."""


def chain_rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniform: torch.Tensor,
    sample_uniform: torch.Tensor,
    greedy: torch.Tensor,
) -> VerifyResult:
    """Accept a prefix of each row's drafts and emit one more token.

    Args:
        target_probs: float ``[B, K+1, V]``: the target's processed distributions p at each draft
            position and after the last one (temperature, top-k, top-p already applied).
        draft_token_ids: int64 ``[B, K]``; row b's drafts are the first ``num_drafts[b]``.
        num_drafts: int64 ``[B]``, each in ``[0, K]`` (0 = plain decoding from ``p_0``).
        draft_probs: float ``[B, K, V]`` draft distributions q the drafts were sampled from, or
            ``None`` for one-hot q (deterministic proposers).
        accept_uniform: float64 ``[B, K]`` i.i.d. U(0, 1) for the accept tests.
        sample_uniform: float64 ``[B]`` U(0, 1) for the recovered or bonus token.
        greedy: bool ``[B]``: rows that decode by argmax.

    Returns:
        A :class:`VerifyResult`.

    Raises:
        ValueError: when shapes disagree.
    """
    b, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    if draft_token_ids.shape != (b, k) or num_drafts.shape != (b,) or accept_uniform.shape != (b, k):
        raise ValueError(
            f"target_probs {tuple(target_probs.shape)}, draft_token_ids {tuple(draft_token_ids.shape)}, "
            f"num_drafts {tuple(num_drafts.shape)}, accept_uniform {tuple(accept_uniform.shape)}: "
            "expected [B, K+1, V], [B, K], [B], [B, K]"
        )
    if draft_probs is not None and draft_probs.shape != (b, k, vocab):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)}, expected {(b, k, vocab)}")
    p = target_probs.double()
    d = draft_token_ids.long()
    p_draft = p[:, :k].gather(-1, d[..., None]).squeeze(-1)  # [B, K] p_i(d_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # one-hot q: q_i(d_i) = 1
    else:
        q_draft = draft_probs.double().gather(-1, d[..., None]).squeeze(-1)
    accept = accept_uniform * q_draft < p_draft  # u < p/q: accept with probability min(1, p/q)
    any_greedy = bool(greedy.any())
    if any_greedy:
        accept = torch.where(greedy[:, None], d == p[:, :k].argmax(-1), accept)
    accept &= torch.arange(k)[None, :] < num_drafts[:, None]
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B] length of the accepted prefix

    j = num_accepted  # position of the emitted extra token
    p_j = p[torch.arange(b), j]  # [B, V]
    rejected = j < num_drafts  # else all drafts passed: bonus token from p_j
    residual = p_j.clone()
    if rejected.any():
        rows = rejected.nonzero().squeeze(-1)
        jr = j[rows]
        if draft_probs is None:
            q_j = torch.zeros_like(residual[rows]).scatter_(-1, d[rows, jr][:, None], 1.0)
        else:
            q_j = draft_probs.double()[rows, jr]
        r = (residual[rows] - q_j).clamp_(min=0)  # max(0, p - q)
        # p == q leaves nothing to resample from; rejection then had probability 0, keep p.
        empty = r.sum(-1) <= 0
        residual[rows] = torch.where(empty[:, None], residual[rows], r)
    extra = draw_inverse_cdf(residual, sample_uniform)
    if any_greedy:
        extra = torch.where(greedy, p_j.argmax(-1), extra)

    pos = torch.arange(k_plus_1)[None, :]
    padded_drafts = torch.cat([d, torch.full((b, 1), -1, dtype=torch.long)], dim=-1)
    tokens = torch.where(pos < j[:, None], padded_drafts, -1)
    tokens = torch.where(pos == j[:, None], extra[:, None], tokens)
    return VerifyResult(tokens, num_accepted)


def verify_drafts(
    logits: torch.Tensor,
    seqs: SequenceOf[Sequence],
    drafts: SequenceOf[list[int]],
    draft_probs: SequenceOf[torch.Tensor | None],
    k: int,
) -> list[tuple[list[int], list[float], int]]:
    """Accept a prefix of each sequence's drafts and emit one more token.

    Args:
        logits: float32 ``[sum(len(d) + 1), V]``: for each sequence in order, the target's logits at
            its last token and at each of its drafts.
        seqs: the sequences, aligned with ``drafts``.
        drafts: per sequence, its drafted token ids (at most ``k``; may be empty).
        draft_probs: per sequence, float ``[len(d), V]`` distributions q its drafts were sampled
            from, or None for one-hot q (deterministic drafts).
        k: the most drafts any sequence has.

    Returns:
        Per sequence ``(emitted token ids, their behavior logprobs, number of drafts accepted)``;
        each logprob is the target's processed-distribution logprob of that token.
    """
    params = [s.sampling for s, d in zip(seqs, drafts, strict=True) for _ in range(len(d) + 1)]
    logprobs = processed_logprobs(logits, params)  # [R, V]
    b, vocab = len(seqs), logits.shape[-1]
    num_drafts_list = [len(d) for d in drafts]
    # Row of (sequence i, position j) in the logits: sequence i's rows follow the earlier ones'.
    # Positions past a sequence's drafts point at its last row; verification never reads them.
    starts, row = [], 0
    for n in num_drafts_list:
        starts.append(row)
        row += n + 1
    num_drafts = torch.tensor(num_drafts_list, dtype=torch.long)  # [B]
    j = torch.arange(k + 1)[None, :]  # [1, K+1]
    rows = torch.tensor(starts, dtype=torch.long)[:, None] + torch.minimum(j, num_drafts[:, None])  # [B, K+1]
    # exp in float32 (relative error ~1e-7; the accept tests and the CDF then run in float64)
    target = logprobs.index_select(0, rows.flatten().to(logprobs.device)).exp().view(b, k + 1, vocab)
    draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long).view(b, k)  # [B, K]
    # One uniform per draft and one for the emitted token, from each request's own generator: a
    # sequence without drafts draws exactly what plain sampling draws, so it emits the same token.
    # Greedy rows draw nothing (their uniforms are unused zeros).
    zeros = torch.zeros(k + 1, dtype=torch.float64)
    uniforms = torch.cat([
        zeros[: n + 1] if seq.sampling.greedy else torch.rand(n + 1, dtype=torch.float64, generator=seq.generator)
        for seq, n in zip(seqs, num_drafts_list, strict=True)
    ])[rows]  # [B, K+1], in the same row order as the logits
    sample_u = uniforms.gather(1, num_drafts[:, None]).squeeze(1)  # [B]: the one after the drafts
    greedy = torch.tensor([s.sampling.greedy for s in seqs], dtype=torch.bool)
    q = None
    if any(probs is not None for probs in draft_probs):
        q = torch.zeros(b, k, vocab, dtype=torch.float64)  # [B, K, V]; one-hot rows for deterministic drafts
        for i, (d, probs) in enumerate(zip(drafts, draft_probs, strict=True)):
            if probs is None:
                q[i, torch.arange(len(d)), torch.tensor(d, dtype=torch.long)] = 1.0
            else:
                q[i, : len(d)] = probs[: len(d)].double()
    result = chain_rejection_sample(target, draft_ids, num_drafts, q, uniforms[:, :k], sample_u, greedy)
    # each emitted token's behavior logprob: token j of row i was scored at logits row rows[i, j]
    emitted = result.token_ids.clamp(min=0)  # [B, K+1]; -1 padding read as token 0, then dropped
    lps = logprobs[rows.to(logprobs.device), emitted.to(logprobs.device)].tolist()  # [B, K+1]
    out = []
    for token_row, lp_row, n in zip(result.token_ids.tolist(), lps, result.num_accepted.tolist(), strict=True):
        out.append((token_row[: n + 1], lp_row[: n + 1], n))
    return out
