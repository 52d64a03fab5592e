"""The trainer's prompts: tokenized once, served in a seeded order that a resumed run continues
(the cursor, and the positions submitted but not yet trained, are saved in its checkpoint).
"""

from __future__ import annotations

import random
from typing import NamedTuple

from specroll.rl.tasks import Prompt


class Draw(NamedTuple):
    """One prompt served: its token ids, the prompt, the group's sampling seed and its position in
    the seeded order (which names the draw across a restart: the same position, the same prompt and seed)."""

    token_ids: list[int]
    prompt: Prompt
    seed: int
    position: int


class PromptCycle:
    """Tokenized prompts served in a seeded order: each pass over them is a fresh shuffle.

    Args:
        token_ids: every prompt's ids (chat template applied).
        prompts: the prompt each entry of ``token_ids`` encodes (its id and reference answer).
        seed: run seed; pass ``e`` uses the permutation of ``random.Random(f"{seed}-{e}")``.
        cursor: prompts already served (restored on resume).
        retry: positions below ``cursor`` served again first, in this order (restored on resume: the
            groups that were submitted and not yet trained when the checkpoint was saved).

    Raises:
        ValueError: no prompts, mismatched lists, or a retry position not below ``cursor``.
    """

    def __init__(self, token_ids: list[list[int]], prompts: list[Prompt], seed: int, cursor: int = 0,
                 retry: list[int] | tuple[int, ...] = ()) -> None:
        if not token_ids or len(token_ids) != len(prompts):
            raise ValueError(f"{len(token_ids)} token id lists and {len(prompts)} prompts; expected equal, non-zero")
        if any(not 0 <= p < cursor for p in retry):
            raise ValueError(f"retry positions {list(retry)[:5]}: expected positions in [0, cursor = {cursor})")
        self.token_ids, self.prompts, self.seed, self.cursor = token_ids, prompts, seed, cursor
        self.retry = list(retry)
        self._epoch, self._order = -1, list(range(len(token_ids)))

    def next(self) -> Draw:
        """The next prompt (a retried position first); advances the cursor otherwise."""
        if self.retry:
            return self.at(self.retry.pop(0))
        self.cursor += 1
        return self.at(self.cursor - 1)

    def at(self, position: int) -> Draw:
        """The prompt at ``position`` of the seeded order, with its sampling seed."""
        epoch, offset = divmod(position, len(self.token_ids))
        if epoch != self._epoch:
            self._order = list(range(len(self.token_ids)))
            random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._epoch = epoch
        index = self._order[offset]
        sampling_seed = ((self.seed << 32) ^ position) & (2**63 - 1)
        return Draw(self.token_ids[index], self.prompts[index], sampling_seed, position)
