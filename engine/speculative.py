"""The verify half of a speculative step: turn the target's logits over ``[last, d1..dk]`` into
emitted tokens, with behavior logprobs, through chain rejection sampling.

The engine appends each decoding sequence's drafts to its step input, so one target forward
scores every draft; here the processed distributions (temperature → top-k → top-p) of those rows
are verified with :func:`~specroll.engine.rejection_sampler.chain_rejection_sample`, using uniforms
drawn from each request's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from specroll.engine.rejection_sampler import chain_rejection_sample
from specroll.engine.sampler import processed_logprobs
from specroll.engine.sequence import Sequence


def verify_drafts(
    logits: torch.Tensor, seqs: SequenceOf[Sequence], drafts: SequenceOf[list[int]], k: int
) -> list[tuple[list[int], list[float], int]]:
    """Accept a prefix of each sequence's drafts and emit one more token.

    Args:
        logits: float32 ``[sum(len(d) + 1), V]``: for each sequence in order, the target's logits at
            its last token and at each of its drafts.
        seqs: the sequences, aligned with ``drafts``.
        drafts: per sequence, its drafted token ids (at most ``k``; may be empty).
        k: the most drafts any sequence has.

    Returns:
        Per sequence ``(emitted token ids, their behavior logprobs, number of drafts accepted)``;
        each logprob is the target's processed-distribution logprob of that token.
    """
    params = [s.sampling for s, d in zip(seqs, drafts, strict=True) for _ in range(len(d) + 1)]
    logprobs = processed_logprobs(logits, params)  # [R, V]
    b, vocab = len(seqs), logits.shape[-1]
    target = torch.zeros(b, k + 1, vocab, dtype=torch.float64)
    draft_ids = torch.zeros(b, k, dtype=torch.long)
    accept_u = torch.zeros(b, k, dtype=torch.float64)
    sample_u = torch.zeros(b, dtype=torch.float64)
    row = 0
    for i, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
        target[i, : len(d) + 1] = logprobs[row : row + len(d) + 1].double().exp()
        draft_ids[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        if not seq.sampling.greedy:
            u = torch.rand(k + 1, dtype=torch.float64, generator=seq.generator)
            accept_u[i], sample_u[i] = u[:k], u[k]
        row += len(d) + 1
    num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    greedy = torch.tensor([s.sampling.greedy for s in seqs], dtype=torch.bool)
    result = chain_rejection_sample(target, draft_ids, num_drafts, None, accept_u, sample_u, greedy)
    out = []
    row = 0
    for i, d in enumerate(drafts):
        n = int(result.num_accepted[i])
        tokens = result.token_ids[i, : n + 1].tolist()
        lps = [float(logprobs[row + j, t]) for j, t in enumerate(tokens)]
        out.append((tokens, lps, n))
        row += len(d) + 1
    return out
