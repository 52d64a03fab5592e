"""Sampling and speculative verification on CUDA through FlashInfer's kernels.

The semantics are the torch reference's (``sampler.py``, ``spec/verify.py``): every row's processed
distribution (temperature → top-k → top-p, computed by :func:`~specroll.engine.sampler.processed_logprobs`
on the GPU) is what is sampled and what the behavior logprob is taken under; FlashInfer only draws.

- Plain decoding: ``flashinfer.sampling.sampling_from_probs`` on the processed probabilities.
- Verification: ``flashinfer.sampling.chain_speculative_sampling`` (Leviathan et al. 2023,
  Algorithm 1: accept d_i when ``u · q_i(d_i) < p_i(d_i)``, resample the first rejection from
  ``norm(max(0, p − q))``, else a bonus token from p_k). The kernel takes one draft count per call,
  so sampled rows are grouped by their number of drafts; rows without drafts sample plainly; a
  deterministic proposer's drafts get a one-hot q (which the kernel handles exactly).
- Greedy rows need no randomness: drafts are accepted while they equal the argmax, as in the
  reference.

Differences from the CPU reference, by design: the random numbers come from one CUDA generator per
engine (seeded from ``EngineConfig.seed``), so a request's ``seed`` fixes its tokens only on the CPU
path — on CUDA the draws depend on the batch, as in FlashInfer and vLLM. The distribution of every
token is the same.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence as SequenceOf

import torch

from specroll.engine.sampler import processed_logprobs
from specroll.engine.sequence import Sequence
from specroll.protocol.sampling import SamplingParams


class FlashInferSampler:
    """Draws tokens and verifies drafts on the GPU.

    Args:
        device: the CUDA device the logits live on.
        seed: seed of the engine's CUDA generator.

    Raises:
        ValueError: the flashinfer package is missing.
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        try:
            import flashinfer.sampling
        except ImportError as exc:
            raise ValueError("CUDA sampling needs the flashinfer package: pip install 'specroll[cuda]'") from exc
        self._sampling = flashinfer.sampling
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: SequenceOf[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its behavior logprob.

        Args:
            logits: float32 ``[B, V]`` on the GPU.
            params: one :class:`SamplingParams` per row.

        Returns:
            int64 ``[B]`` tokens and float32 ``[B]`` logprobs under the processed distribution (CPU).
        """
        logprobs = processed_logprobs(logits, params)  # [B, V]
        tokens = logprobs.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            drawn = self._sampling.sampling_from_probs(logprobs[rows].exp(), generator=self.generator)
            tokens[rows] = drawn.long()
        return tokens.cpu(), logprobs.gather(-1, tokens[:, None]).squeeze(-1).cpu()

    def verify(
        self,
        logits: torch.Tensor,
        seqs: SequenceOf[Sequence],
        drafts: SequenceOf[list[int]],
        draft_probs: SequenceOf[torch.Tensor | None],
        k: int,
    ) -> list[tuple[list[int], list[float], int]]:
        """Accept a prefix of each sequence's drafts and emit one more token; the arguments and
        result are those of :func:`~specroll.engine.spec.verify.verify_drafts` (``logits`` on the GPU)."""
        params = [s.sampling for s, d in zip(seqs, drafts, strict=True) for _ in range(len(d) + 1)]
        logprobs = processed_logprobs(logits, params)  # [R, V]
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        emitted: list[list[int]] = [[] for _ in seqs]
        argmax: list[int] | None = None
        by_count: dict[int, list[int]] = defaultdict(list)
        for i, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
            if seq.sampling.greedy:
                if argmax is None:
                    argmax = logprobs.argmax(dim=-1).tolist()
                best = argmax[starts[i] : starts[i + 1]]
                n = next((j for j, t in enumerate(d) if t != best[j]), len(d))
                emitted[i] = best[: n + 1]
            else:
                by_count[len(d)].append(i)
        for n, members in by_count.items():
            if n == 0:
                probs = logprobs[torch.tensor([starts[i] for i in members], device=logits.device)].exp()
                drawn = self._sampling.sampling_from_probs(probs, generator=self.generator).tolist()
                for i, token in zip(members, drawn, strict=True):
                    emitted[i] = [token]
                continue
            rows = torch.tensor([[starts[i] + j for j in range(n + 1)] for i in members], device=logits.device)
            target = logprobs[rows].exp()  # [G, n+1, V]
            ids = torch.tensor([drafts[i] for i in members], device=logits.device)  # [G, n]
            q = torch.stack([self._draft_q(draft_probs[i], ids[g], n, logits.shape[-1])
                             for g, i in enumerate(members)])  # [G, n, V]
            out, _, accepted = self._sampling.chain_speculative_sampling(q, ids, target, generator=self.generator)
            for i, row, a in zip(members, out.tolist(), accepted.tolist(), strict=True):
                emitted[i] = row[: a + 1]
        flat_rows = [starts[i] + j for i, tokens in enumerate(emitted) for j in range(len(tokens))]
        flat_tokens = [t for tokens in emitted for t in tokens]
        lps = logprobs[torch.tensor(flat_rows, device=logits.device),
                       torch.tensor(flat_tokens, device=logits.device)].tolist()
        out_rows, at = [], 0
        for tokens in emitted:
            out_rows.append((tokens, lps[at : at + len(tokens)], len(tokens) - 1))
            at += len(tokens)
        return out_rows

    def _draft_q(self, probs: torch.Tensor | None, ids: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
        """float32 ``[n, V]``: the proposer's q, or one-hot rows for deterministic drafts."""
        if probs is not None:
            return probs[:n].to(self.device, torch.float32)
        return torch.zeros(n, vocab, device=self.device).scatter_(-1, ids[:, None], 1.0)
