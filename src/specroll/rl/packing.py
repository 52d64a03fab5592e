"""Packing what a step trains into one batch: rows that each hold a prompt once and the
continuations that follow it, every continuation attending to its row's prompt and to itself only.

A continuation is a single-turn response, or the tokens after an episode's first prompt (its model
turns with the environment's tokens between them, which stay out of the loss: ``rl/episodes.py``).
:func:`build_batch` packs G finished groups of n single-turn samples (one row each);
:func:`pack_rows` is the general form both use.

Packing is exact, not an approximation: a continuation token's logits depend only on the prompt and
the continuation before it, as in ``prompt + continuation`` alone (checked against
``CausalLM.score`` in the tests), while the prompt runs once per row instead of once per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from specroll.rl.coordinator import Group
from specroll.rl.grpo import group_advantages

__all__ = ["Continuation", "PackedRow", "RolloutBatch", "build_batch", "pack_rows"]


@dataclass(frozen=True)
class Continuation:
    """Tokens that follow a row's prompt, and which of them the loss trains.

    Attributes:
        token_ids: the continuation's token ids.
        logprobs: the behavior logprob of each token (natural log; read only where ``trained``).
        versions: the policy version that sampled each token (read only where ``trained``).
        trained: True at the tokens the policy produced and the loss trains; None: every token.
        sample: the index (into the flattened ``[G·n]`` advantages) of the sample it belongs to.
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    trained: Sequence[bool] | None
    sample: int


@dataclass(frozen=True)
class PackedRow:
    """One row of the batch: a prompt (non-empty) and the continuations packed after it."""

    prompt_token_ids: Sequence[int]
    continuations: Sequence[Continuation]


@dataclass(frozen=True)
class RolloutBatch:
    """R packed rows and S continuations (L = the longest continuation). The continuations of row r
    are ``row_starts[r]:row_starts[r + 1]``; entry ``[s, j]`` of the per-continuation tensors
    describes token ``j`` of continuation ``s``."""

    input_ids: torch.Tensor
    """int64 ``[R, T]``: row r = its prompt, then its continuations in order, then ``pad_id``."""
    positions: torch.Tensor
    """int64 ``[R, T]``: RoPE positions: the prompt 0..P−1, every continuation again from P."""
    segments: torch.Tensor
    """int64 ``[R, T]``: 0 on the prompt, i + 1 on the row's continuation i, −1 on padding."""
    row_lengths: torch.Tensor
    """int64 ``[R]``: real tokens of each row."""
    row_starts: torch.Tensor
    """int64 ``[R + 1]``: the first continuation of each row, and S at the end."""
    predecessor: torch.Tensor
    """int64 ``[S, L]``: the position in its row whose output predicts token j (the last prompt
    token for j = 0, else the continuation's token j − 1); 0 where there is no token."""
    targets: torch.Tensor
    """int64 ``[S, L]``: the continuation token ids (``pad_id`` past the end)."""
    loss_mask: torch.Tensor
    """bool ``[S, L]``: True at trained tokens (the policy's own; not the environment's, not padding)."""
    behavior_logprobs: torch.Tensor
    """float32 ``[S, L]``: the generators' logprob of each trained token (0 elsewhere)."""
    versions: torch.Tensor
    """int64 ``[S, L]``: the policy version that sampled each trained token (``fill_version``
    elsewhere; never read there)."""
    advantages: torch.Tensor
    """float32 ``[S]``: the GRPO advantage of each continuation (its sample's, shared by its tokens)."""

    def to(self, device: torch.device | str) -> RolloutBatch:
        """This batch with every tensor on ``device`` (the trainer's ``trainer.device``)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def continuations_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The continuations of ``rows`` (int64 ``[g]``), in row order: ``(indices [s], local row
        [s])``, the local row being each one's position in ``rows``."""
        starts, ends = self.row_starts[rows], self.row_starts[rows + 1]  # [g] each
        counts = ends - starts  # [g]
        local = torch.repeat_interleave(torch.arange(len(rows), device=rows.device), counts)  # [s]
        first = torch.cumsum(counts, 0) - counts  # [g]: where each row's continuations begin in the result
        indices = starts[local] + torch.arange(int(counts.sum()), device=rows.device) - first[local]  # [s]
        return indices, local

    def attention_mask(self, rows: torch.Tensor, t: int) -> torch.Tensor:
        """bool ``[len(rows), t, t]``: query i attends key j when j ≤ i, j is real, and j is on the
        prompt or on i's own continuation."""
        seg = self.segments[rows, :t]  # [g, t]
        idx = torch.arange(t, device=seg.device)
        causal = idx[None, :] <= idx[:, None]  # [t, t]
        key, query = seg[:, None, :], seg[:, :, None]  # [g, 1, t], [g, t, 1]
        return causal & (key >= 0) & ((key == 0) | (key == query))


def pack_rows(rows: Sequence[PackedRow], advantages: torch.Tensor, *, fill_version: int,
              pad_id: int = 0) -> RolloutBatch:
    """Pack ``rows`` into one batch (see :class:`RolloutBatch`).

    Args:
        rows: the rows, each with a non-empty prompt.
        advantages: float ``[B]``: every sample's advantage; continuation ``c`` takes ``advantages[c.sample]``.
        fill_version: version written where there is no trained token (outside the loss mask).
        pad_id: token id at padding positions (masked everywhere; any valid id).

    Raises:
        ValueError: no rows, an empty prompt, a continuation whose token ids, logprobs, versions and
            ``trained`` differ in length, or whose ``sample`` is outside ``advantages``.
    """
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    conts = [c for row in rows for c in row.continuations]
    for r, row in enumerate(rows):
        if not row.prompt_token_ids:
            raise ValueError(f"row {r}: empty prompt")
        for c in row.continuations:
            sizes = {len(c.token_ids), len(c.logprobs), len(c.versions)}
            sizes |= {len(c.trained)} if c.trained is not None else set()
            if len(sizes) != 1:
                raise ValueError(f"row {r} continuation of sample {c.sample}: {len(c.token_ids)} tokens, "
                                 f"{len(c.logprobs)} logprobs, {len(c.versions)} versions"
                                 + (f", {len(c.trained)} trained flags" if c.trained is not None else ""))
            if not 0 <= c.sample < len(advantages):
                raise ValueError(f"row {r}: continuation of sample {c.sample}; expected one of the {len(advantages)} "
                                 "samples")
    lengths = [len(row.prompt_token_ids) + sum(len(c.token_ids) for c in row.continuations) for row in rows]
    R, T, S = len(rows), max(lengths), len(conts)
    L = max(max((len(c.token_ids) for c in conts), default=0), 1)
    input_ids = torch.full((R, T), pad_id, dtype=torch.int64)  # [R, T]
    positions = torch.zeros(R, T, dtype=torch.int64)  # [R, T]
    segments = torch.full((R, T), -1, dtype=torch.int64)  # [R, T]
    predecessor = torch.zeros(S, L, dtype=torch.int64)  # [S, L]
    targets = torch.full((S, L), pad_id, dtype=torch.int64)  # [S, L]
    loss_mask = torch.zeros(S, L, dtype=torch.bool)  # [S, L]
    behavior = torch.zeros(S, L, dtype=torch.float32)  # [S, L]
    versions = torch.full((S, L), fill_version, dtype=torch.int64)  # [S, L]
    row_starts = [0]
    b = 0
    for r, row in enumerate(rows):
        p = len(row.prompt_token_ids)
        input_ids[r, :p] = torch.tensor(list(row.prompt_token_ids), dtype=torch.int64)
        positions[r, :p] = torch.arange(p)
        segments[r, :p] = 0
        start = p  # where the next continuation begins in the row
        for i, c in enumerate(row.continuations):
            n = len(c.token_ids)
            if n:
                input_ids[r, start : start + n] = torch.tensor(list(c.token_ids), dtype=torch.int64)
                positions[r, start : start + n] = torch.arange(p, p + n)
                segments[r, start : start + n] = i + 1
                predecessor[b, 0] = p - 1
                predecessor[b, 1:n] = torch.arange(start, start + n - 1)
                targets[b, :n] = torch.tensor(list(c.token_ids), dtype=torch.int64)
                trained = torch.ones(n, dtype=torch.bool) if c.trained is None else torch.tensor(list(c.trained))
                loss_mask[b, :n] = trained
                behavior[b, :n] = torch.where(trained, torch.tensor(list(c.logprobs), dtype=torch.float32), 0.0)
                versions[b, :n] = torch.where(trained, torch.tensor(list(c.versions), dtype=torch.int64), fill_version)
                start += n
            b += 1
        row_starts.append(b)
    sample_of = torch.tensor([c.sample for c in conts], dtype=torch.int64)  # [S]
    return RolloutBatch(input_ids, positions, segments, torch.tensor(lengths), torch.tensor(row_starts), predecessor,
                        targets, loss_mask, behavior, versions, advantages.float()[sample_of])


def build_batch(
    groups: Sequence[Group], rewards: torch.Tensor, *, normalize_std: bool, fill_version: int, pad_id: int = 0
) -> RolloutBatch:
    """Pack G finished single-turn groups into G rows: row g is group g's prompt, then its n
    responses (continuation i of row g is sample ``g·n + i``).

    Args:
        groups: G finished groups of n samples each (prompts non-empty).
        rewards: float ``[G, n]``: the reward of every sample.
        normalize_std: GRPO (divide by the group's std) or Dr. GRPO advantages (``grpo.group_advantages``).
        fill_version: version written where there is no response token (outside the loss mask).
        pad_id: token id at padding positions (masked everywhere; any valid id).

    Raises:
        ValueError: no groups, groups of unequal size, ``rewards`` not ``[G, n]``, an empty prompt,
            or a sample whose token ids, logprobs and versions differ in length.
    """
    if not groups:
        raise ValueError("build_batch needs at least one group")
    n = len(groups[0].samples)
    if any(len(g.samples) != n for g in groups) or tuple(rewards.shape) != (len(groups), n):
        raise ValueError(f"expected {len(groups)} groups of {n} samples and rewards [G, n]; got group sizes "
                         f"{[len(g.samples) for g in groups]} and rewards {tuple(rewards.shape)}")
    for g in groups:
        if not g.prompt_token_ids:
            raise ValueError(f"group {g.group_id}: empty prompt")
        for i, s in enumerate(g.samples):
            if not len(s.token_ids) == len(s.logprobs) == len(s.versions):
                raise ValueError(f"group {g.group_id} sample {i}: {len(s.token_ids)} tokens, {len(s.logprobs)} "
                                 f"logprobs and {len(s.versions)} versions")
    advantages = group_advantages(rewards, normalize_std).flatten()  # [B]
    rows = [PackedRow(g.prompt_token_ids, [Continuation(s.token_ids, s.logprobs, s.versions, None, r * n + i)
                                           for i, s in enumerate(g.samples)])
            for r, g in enumerate(groups)]
    return pack_rows(rows, advantages, fill_version=fill_version, pad_id=pad_id)
