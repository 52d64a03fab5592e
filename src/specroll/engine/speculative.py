"""The verify half of a speculative step: turn the target's logits over ``[last, d1..dk]`` into
emitted tokens, with behavior logprobs, through chain rejection sampling.

The engine appends each decoding sequence's drafts to its step input, so one target forward
scores every draft; here the processed distributions (temperature → top-k → top-p) of those rows
are verified with :func:`~specroll.engine.rejection_sampler.chain_rejection_sample`, using uniforms
drawn from each request's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from specroll.engine.rejection_sampler import chain_rejection_sample
from specroll.engine.sampler import processed_logprobs
from specroll.engine.sequence import Sequence


@dataclass
class SpeculativeStats:
    """Speculative-decoding counters: of one step (``Engine.last_step_stats``) or summed over a
    run (``Engine.spec_stats``)."""

    num_steps: int = 0
    """Engine steps counted."""
    k: int = 0
    """Draft length chosen for the step (the last step's, in a sum)."""
    num_drafted: int = 0
    """Draft tokens verified."""
    num_accepted: int = 0
    """Draft tokens accepted."""
    num_draft_steps: int = 0
    """(sequence, step) pairs that verified at least one draft."""
    num_emitted: int = 0
    """Tokens emitted by decoding sequences (accepted + one recovered or bonus token each)."""
    draft_time_s: float = 0.0
    """Seconds spent proposing."""
    verify_time_s: float = 0.0
    """Seconds of the target's forward pass and the rejection sampling."""

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per drafting (sequence, step): ``1 + accepted / draft steps`` (1.0 before any)."""
        return 1.0 + self.num_accepted / self.num_draft_steps if self.num_draft_steps else 1.0

    def add(self, step: SpeculativeStats) -> None:
        """Fold one step's counters into this sum."""
        self.num_steps += step.num_steps
        self.k = step.k
        self.num_drafted += step.num_drafted
        self.num_accepted += step.num_accepted
        self.num_draft_steps += step.num_draft_steps
        self.num_emitted += step.num_emitted
        self.draft_time_s += step.draft_time_s
        self.verify_time_s += step.verify_time_s


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
    target = torch.zeros(b, k + 1, vocab, dtype=torch.float64)
    draft_ids = torch.zeros(b, k, dtype=torch.long)
    accept_u = torch.zeros(b, k, dtype=torch.float64)
    sample_u = torch.zeros(b, dtype=torch.float64)
    row = 0
    for i, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
        target[i, : len(d) + 1] = logprobs[row : row + len(d) + 1].double().exp()
        draft_ids[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        if not seq.sampling.greedy:
            # One uniform per draft and one for the emitted token: a sequence without drafts draws
            # exactly what plain sampling draws, so it emits the same token.
            u = torch.rand(len(d) + 1, dtype=torch.float64, generator=seq.generator)
            accept_u[i, : len(d)], sample_u[i] = u[: len(d)], u[len(d)]
        row += len(d) + 1
    num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    greedy = torch.tensor([s.sampling.greedy for s in seqs], dtype=torch.bool)
    q = None
    if any(probs is not None for probs in draft_probs):
        q = torch.zeros(b, k, vocab, dtype=torch.float64)  # [B, K, V]; one-hot rows for deterministic drafts
        for i, (d, probs) in enumerate(zip(drafts, draft_probs, strict=True)):
            if probs is None:
                q[i, torch.arange(len(d)), torch.tensor(d, dtype=torch.long)] = 1.0
            else:
                q[i, : len(d)] = probs[: len(d)].double()
    result = chain_rejection_sample(target, draft_ids, num_drafts, q, accept_u, sample_u, greedy)
    out = []
    row = 0
    for i, d in enumerate(drafts):
        n = int(result.num_accepted[i])
        tokens = result.token_ids[i, : n + 1].tolist()
        lps = [float(logprobs[row + j, t]) for j, t in enumerate(tokens)]
        out.append((tokens, lps, n))
        row += len(d) + 1
    return out
