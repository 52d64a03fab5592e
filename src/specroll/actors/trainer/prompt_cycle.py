"""The trainer's prompts: tokenized once, served in a seeded order that a resumed run continues
(the cursor is saved in its checkpoint).
"""

from __future__ import annotations

import random

from specroll.rl.tasks import Prompt


class PromptCycle:
    """Tokenized prompts served in a seeded order: each pass over them is a fresh shuffle.

    Args:
        token_ids: every prompt's ids (chat template applied).
        prompts: the prompt each entry of ``token_ids`` encodes (its id and reference answer).
        seed: run seed; pass ``e`` uses the permutation of ``random.Random(f"{seed}-{e}")``.
        cursor: prompts already served (restored on resume).
    """

    def __init__(self, token_ids: list[list[int]], prompts: list[Prompt], seed: int, cursor: int = 0) -> None:
        if not token_ids or len(token_ids) != len(prompts):
            raise ValueError(f"{len(token_ids)} token id lists and {len(prompts)} prompts; expected equal, non-zero")
        self.token_ids, self.prompts, self.seed, self.cursor = token_ids, prompts, seed, cursor
        self._epoch, self._order = -1, list(range(len(token_ids)))

    def next(self) -> tuple[list[int], Prompt, int]:
        """The next prompt: ``(token ids, prompt, sampling seed)``; advances the cursor."""
        epoch, position = divmod(self.cursor, len(self.token_ids))
        if epoch != self._epoch:
            self._order = list(range(len(self.token_ids)))
            random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._epoch = epoch
        index = self._order[position]
        sampling_seed = ((self.seed << 32) ^ self.cursor) & (2**63 - 1)
        self.cursor += 1
        return self.token_ids[index], self.prompts[index], sampling_seed
