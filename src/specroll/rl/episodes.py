"""Multi-turn episodes as the trainer trains them: the turns the generators ran, stitched into the
token sequences they saw, the environment's tokens kept out of the loss.

An episode is a prompt and alternating model turns and environment turns (tool results, a user's
reply). Each model turn is one request the generators ran: the exact prompt token ids it was given
and the token ids, behavior logprobs and policy versions it produced (:class:`Turn`). The trained
sequence is exactly what the generators saw and produced, never re-tokenized text:

- when turn k + 1's prompt starts with turn k's prompt and completion (token-in-token-out: the
  server builds it so with a session, ``actors/server/stitch.py``), the two are one sequence: the
  tokens between them are the environment's, in the sequence and out of the loss;
- when it does not (a chat template that drops earlier reasoning — Qwen3's drops ``<think>`` blocks
  of earlier turns —, a tool set that changed, a client that rewrote the history), turn k + 1 starts
  a new sequence with its own prompt; nothing is guessed, and the number of sequences per episode is
  reported (``EpisodeStats.sequences``).

Every sequence of an episode carries the episode's advantage; a group is n episodes of one prompt,
normalised together (GRPO, ``grpo.group_advantages``). :func:`pack_episode_groups` packs them into
the batch ``grpo_step.train_step`` trains (``packing.py``: the sequences that share a prompt share
a row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specroll.rl.grpo import group_advantages
from specroll.rl.packing import Continuation, PackedRow, RolloutBatch, pack_rows

__all__ = ["Episode", "EpisodeGroup", "Segment", "Turn", "pack_episode_groups", "stitch"]


@dataclass(frozen=True)
class Turn:
    """One model turn: a request the generators ran (a served chat or completion request).

    Attributes:
        prompt_token_ids: the exact prompt it was given.
        token_ids: what it produced (the stop token included when it stopped on one).
        logprobs: the behavior logprob of each token (natural log, the processed distribution).
        versions: the policy version of the weights that produced each token.
        finish_reason: ``stop``, ``length`` or ``abort``.
        tool_calls: tool calls parsed out of its text.
        tool_call_errors: ``<tool_call>`` blocks in its text that did not parse (bad JSON, an unknown
            tool): counted, since a model that never writes a parseable call never learns to call.
        seconds: wall time from the request's arrival to its last token.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None = None
    tool_calls: int = 0
    tool_call_errors: int = 0
    seconds: float = 0.0


@dataclass
class Segment:
    """One trained sequence of an episode: a prompt and what followed it — model tokens
    (``trained``) and the environment's tokens between turns (not trained)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """The behavior logprob of each model token (0.0 at the environment's)."""
    versions: list[int] = field(default_factory=list)
    """The policy version of each model token (-1 at the environment's; never read there)."""
    trained: list[bool] = field(default_factory=list)

    def extend(self, environment: Sequence[int], turn: Turn) -> None:
        """Append the environment's tokens, then ``turn``'s completion."""
        self.token_ids += [*environment, *turn.token_ids]
        self.logprobs += [0.0] * len(environment) + list(turn.logprobs)
        self.versions += [-1] * len(environment) + list(turn.versions)
        self.trained += [False] * len(environment) + [True] * len(turn.token_ids)


def stitch(turns: Sequence[Turn]) -> list[Segment]:
    """The sequences ``turns`` train as (module docstring): a turn whose prompt extends the sequence
    so far (prompt + everything after it) continues it, its new prompt tokens being the environment's;
    any other turn starts a new sequence.

    Raises:
        ValueError: a turn with an empty prompt, or whose token ids, logprobs and versions differ
            in length.
    """
    segments: list[Segment] = []
    for k, turn in enumerate(turns):
        if not turn.prompt_token_ids:
            raise ValueError(f"turn {k}: empty prompt")
        if not len(turn.token_ids) == len(turn.logprobs) == len(turn.versions):
            raise ValueError(f"turn {k}: {len(turn.token_ids)} tokens, {len(turn.logprobs)} logprobs and "
                             f"{len(turn.versions)} versions")
        if segments:
            last = segments[-1]
            seen = len(last.prompt_token_ids) + len(last.token_ids)
            prompt = turn.prompt_token_ids
            if len(prompt) >= seen and prompt[: len(last.prompt_token_ids)] == last.prompt_token_ids \
                    and prompt[len(last.prompt_token_ids) : seen] == last.token_ids:
                last.extend(prompt[seen:], turn)
                continue
        segment = Segment(list(turn.prompt_token_ids))
        segment.extend((), turn)
        segments.append(segment)
    return segments


@dataclass
class Episode:
    """One finished episode: its turns, its reward and what its environment reported.

    Attributes:
        turns: the model turns, in order.
        reward: the environment's reward for the episode.
        metrics: figures the environment reported (e.g. ``tool_latency_s``), averaged per step.
        seconds: wall time of the whole episode.
    """

    turns: list[Turn]
    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def segments(self) -> list[Segment]:
        return stitch(self.turns)


@dataclass
class EpisodeGroup:
    """n finished episodes of one prompt.

    Attributes:
        group_id: unique in the run.
        payload: what the prompt came with (the task's :class:`~specroll.rl.tasks.Prompt`).
        episodes: the n episodes.
        retries: episodes that failed (an environment error, a timeout) and ran again.
    """

    group_id: str
    payload: object
    episodes: list[Episode]
    retries: int = 0


def pack_episode_groups(groups: Sequence[EpisodeGroup], *, normalize_std: bool, fill_version: int,
                        pad_id: int = 0) -> tuple[torch.Tensor, RolloutBatch]:
    """Rewards ``[G, n]`` and the packed batch of G groups of n episodes: each episode's sequences
    (:func:`stitch`) carry its advantage; within a group, sequences with the same prompt share a row
    (the n first sequences of a group, usually).

    Raises:
        ValueError: no groups, groups of unequal size, an episode with no turn, or a malformed turn.
    """
    if not groups:
        raise ValueError("pack_episode_groups needs at least one group")
    n = len(groups[0].episodes)
    if n == 0 or any(len(g.episodes) != n for g in groups):
        raise ValueError(f"expected groups of equal, non-zero size; got {[len(g.episodes) for g in groups]}")
    for g in groups:
        for i, e in enumerate(g.episodes):
            if not e.turns:
                raise ValueError(f"group {g.group_id} episode {i}: no turn")
    rewards = torch.tensor([[e.reward for e in g.episodes] for g in groups], dtype=torch.float32)  # [G, n]
    advantages = group_advantages(rewards, normalize_std).flatten()  # [G·n]
    rows: list[PackedRow] = []
    for gi, g in enumerate(groups):
        by_prompt: dict[tuple[int, ...], list[Continuation]] = {}
        for i, e in enumerate(g.episodes):
            for s in e.segments:
                by_prompt.setdefault(tuple(s.prompt_token_ids), []).append(
                    Continuation(s.token_ids, s.logprobs, s.versions, s.trained, gi * n + i))
        rows += [PackedRow(list(prompt), conts) for prompt, conts in by_prompt.items()]
    return rewards, pack_rows(rows, advantages, fill_version=fill_version, pad_id=pad_id)
