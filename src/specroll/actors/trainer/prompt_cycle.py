"""The trainer's prompts: tokenized once, served in a seeded order that a resumed run continues
(the cursor is saved in its checkpoint).
"""

from __future__ import annotations

import random


class PromptCycle:
    """Tokenized prompts served in a seeded order: each pass over them is a fresh shuffle.

    Args:
        token_ids: every prompt's ids (chat template applied).
        answers: the reference answer of each prompt (the reward's ground truth).
        seed: run seed; pass ``e`` uses the permutation of ``random.Random(f"{seed}-{e}")``.
        cursor: prompts already served (restored on resume).
    """

    def __init__(self, token_ids: list[list[int]], answers: list[str | None], seed: int, cursor: int = 0) -> None:
        if not token_ids or len(token_ids) != len(answers):
            raise ValueError(f"{len(token_ids)} prompts and {len(answers)} answers; expected equal, non-zero")
        self.token_ids, self.answers, self.seed, self.cursor = token_ids, answers, seed, cursor
        self._epoch, self._order = -1, list(range(len(token_ids)))

    def next(self) -> tuple[list[int], str | None, int]:
        """The next prompt: ``(token ids, answer, sampling seed)``; advances the cursor."""
        epoch, position = divmod(self.cursor, len(self.token_ids))
        if epoch != self._epoch:
            self._order = list(range(len(self.token_ids)))
            random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._epoch = epoch
        index = self._order[position]
        sampling_seed = ((self.seed << 32) ^ self.cursor) & (2**63 - 1)
        self.cursor += 1
        return self.token_ids[index], self.answers[index], sampling_seed
