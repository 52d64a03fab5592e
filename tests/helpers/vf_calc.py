"""A multi-turn ``verifiers`` taskset with a calculator tool for the tests
(``task.environment = "verifiers:helpers.vf_calc"``): the model may call ``calculator_calculate``
(an MCP tool, ``vf.Toolset``) and then answers; reward 1 when its last reply's ``#### <number>`` is
the answer.

The toolset is taskset-scoped (``Taskset.toolsets``): ``verifiers`` serves it from one process for
the whole environment (``python -m helpers.vf_calc``, so ``tests/`` must be on its PYTHONPATH), not
one per rollout as a task-scoped toolset (``Task.toolsets``) would. Imports ``verifiers.v1``: only
tests that found verifiers installed import it."""

from __future__ import annotations

import ast
import operator

import verifiers.v1 as vf

from helpers.vf_arith import QUESTIONS, ArithData, final_number

__all__ = ["CalcTaskset"]

SYSTEM = "Solve the problem with the calculator tool. End with the final answer as '#### <number>'."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only integers, + - *")


class CalculatorToolset(vf.Toolset[vf.SharedToolsetConfig]):
    """``calculator_calculate(expression)``: the value of ``+ - *`` over integers."""

    TOOL_PREFIX = "calculator"

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression such as '6*7' and return the result."""
        try:
            return str(_value(ast.parse(expression, mode="eval").body))
        except (SyntaxError, ValueError) as e:
            return f"error: {e}"


class CalcTask(vf.Task[ArithData]):
    """Turns until a reply without a tool call (the harness's loop; ``max_turns`` caps it)."""

    @vf.reward(weight=1.0)
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(final_number(trace.last_reply) == str(self.data.answer))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    """The questions of ``helpers.vf_arith.QUESTIONS`` with the calculator."""

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.SharedToolsetConfig())]

    def load(self):
        for task_id, prompt, answer in QUESTIONS:
            yield CalcTask(ArithData(id=task_id, prompt=prompt, system_prompt=SYSTEM, answer=answer))


if __name__ == "__main__":  # how verifiers starts the tool server
    CalculatorToolset.run()
