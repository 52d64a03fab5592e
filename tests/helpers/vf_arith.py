"""A single-turn ``verifiers`` taskset for the tests (``task.environment = "verifiers:helpers.vf_arith"``):
arithmetic questions, one model turn, reward 1 when the reply's last ``#### <number>`` is the answer.

Imports ``verifiers.v1``: only tests that found verifiers installed import it."""

from __future__ import annotations

import re

import verifiers.v1 as vf

__all__ = ["ArithTaskset"]

SYSTEM = "Solve the problem. End with the final answer on its own line as '#### <number>'."
QUESTIONS = (("six-times-seven", "What is 6 * 7?", 42), ("thirteen-plus-29", "What is 13 + 29?", 42),
             ("hundred-minus-58", "What is 100 - 58?", 42), ("nine-squared", "What is 9 * 9?", 81))
"""(task id, prompt, answer)."""


def final_number(text: str) -> str | None:
    """The number after the last ``####`` of ``text``, without commas or a trailing full stop."""
    found = re.findall(r"####\s*(-?[\d.,]+)", text or "")
    return found[-1].replace(",", "").rstrip(".") if found else None


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    """One turn (a second model call is refused); the reward is the exact match of the final number."""

    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(final_number(trace.last_reply) == str(self.data.answer))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    """The questions of :data:`QUESTIONS`, in order."""

    def load(self):
        for task_id, prompt, answer in QUESTIONS:
            yield ArithTask(ArithData(id=task_id, prompt=prompt, system_prompt=SYSTEM, answer=answer))
