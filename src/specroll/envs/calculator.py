"""The built-in tool task: arithmetic the default model cannot do in its head, with a calculator
tool whose latency is real wall time.

Each prompt is a built-in problem ("What is 37 * 48?", ``task.digits``-digit operands). The model is
shown the tool in the Hermes format the server writes for SmolLM2 (``actors/server/tool_prompt.py``)
and two worked examples (a call, the tool's result, the answer): without them SmolLM2-135M-Instruct
wrote no tool call in 128 samples at T = 1; with them about a third of its first replies are a
parseable call. An episode: the model replies; each tool call it makes is answered after a latency
drawn from a lognormal distribution (``task.tool_latency_median_s`` and ``task.tool_latency_p99_s``)
with the expression's value; until it answers without a call, or ``task.max_turns`` replies. The
reward: 1 when the last number of its last reply is the answer (``rl.tasks.gsm8k_reward``).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import openai

from specroll.envs.base import EpisodeOutcome, EpisodePrompt
from specroll.rl.tasks import gsm8k_reward

SYSTEM = "You are a helpful assistant. Use the calculator tool for arithmetic."
TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression and return the result.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 37 * 48"}},
                   "required": ["expression"]}}}
EXAMPLES = ((23, 41), (57, 18))
"""The worked examples shown before each question (not drawn from the task's problems: both
operands of a two-digit product)."""
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15
"""The calculator refuses longer expressions and larger intermediate values (bounded work)."""


@dataclass(frozen=True)
class Latency:
    """A tool's latency in seconds: lognormal with median ``median_s`` and 99th percentile
    ``p99_s`` (``ln X ~ N(ln median, σ)``, σ = ln(p99 / median) / z₀.₉₉, z₀.₉₉ = 2.3263); 0 when
    ``median_s`` is 0; constant when ``p99_s`` equals it.

    Raises:
        ValueError: a negative median, or a p99 below the median.
    """

    median_s: float = 0.0
    p99_s: float = 0.0

    def __post_init__(self) -> None:
        if self.median_s < 0 or (self.p99_s < self.median_s and self.median_s > 0):
            raise ValueError(f"tool latency median {self.median_s} s, p99 {self.p99_s} s: expected 0 <= median <= p99")

    def sample(self, rng: random.Random) -> float:
        if self.median_s == 0:
            return 0.0
        sigma = math.log(self.p99_s / self.median_s) / 2.3263
        return self.median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


_OPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                               ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression of numbers, ``+ - * /`` and parentheses, written as the
    tool's result (an integer without a decimal point); ``error: ...`` for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    else:
        raise ValueError("only numbers, + - * / and parentheses")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value beyond {MAX_MAGNITUDE:.0e}")
    return value


def _examples() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for k, (a, b) in enumerate(EXAMPLES):
        call = {"id": f"example_{k}", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})}}
        messages += [{"role": "user", "content": f"What is {a} * {b}?"},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": str(a * b)},
                     {"role": "assistant", "content": str(a * b)}]
    return messages


def messages_for(question: str) -> list[dict[str, Any]]:
    """The first request's messages: the system prompt, the worked examples, the question."""
    return [{"role": "system", "content": SYSTEM}, *_examples(), {"role": "user", "content": question}]


class CalculatorEnv:
    """The built-in tool task as an environment (``specroll.envs.base.Environment``).

    Args:
        latency: the tool's latency.
        max_turns: the model's replies per episode at most.
    """

    def __init__(self, latency: Latency, max_turns: int) -> None:
        self.latency, self.max_turns = latency, max_turns

    async def __call__(self, client: openai.AsyncOpenAI, prompt: EpisodePrompt) -> EpisodeOutcome:
        rng = random.Random(prompt.seed)
        messages = messages_for(prompt.question)
        waited, calls, content = 0.0, 0, ""
        for turn in range(self.max_turns):
            try:
                reply = await client.chat.completions.create(model=prompt.model, messages=messages, tools=[TOOL],
                                                             **prompt.sampling)
            except openai.BadRequestError:
                if turn == 0:
                    raise  # the first prompt does not fit: a setting to fix, not an episode to score
                content = ""  # the conversation outgrew the context: the episode ends unanswered
                break
            message = reply.choices[0].message
            content = message.content or ""
            tool_calls = message.tool_calls or []
            messages.append({"role": "assistant", "content": message.content,
                             "tool_calls": [c.model_dump() for c in tool_calls] or None})
            if not tool_calls:
                break
            for call in tool_calls:
                delay = self.latency.sample(rng)
                await anyio.sleep(delay)
                waited += delay
                calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": _result(call.function.arguments)})
        return EpisodeOutcome(gsm8k_reward(content, prompt.answer), {"tool_latency_s": waited, "tool_calls": calls})


def _result(arguments: str) -> str:
    try:
        expression = json.loads(arguments).get("expression")
    except (ValueError, AttributeError):
        return "error: arguments are not a JSON object"
    if not isinstance(expression, str):
        return "error: expected a string 'expression'"
    return calculate(expression)
