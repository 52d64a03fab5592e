"""Prompt sources and rewards for RL rollouts: GSM8K-style JSONL files, the built-in arithmetic task
(with its held-out evaluation set), and the "last number in the response" reward.

A task is a list of `Prompt`s plus a reward function `(response, answer) -> float`. Everything here
is pure Python and CPU-only; `load_prompts` is the one function that touches the file system.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import msgspec

__all__ = [
    "ARITHMETIC_INSTRUCTION",
    "OPERATORS",
    "REWARDS",
    "Prompt",
    "PromptFileError",
    "RewardFn",
    "TaskSplit",
    "builtin_prompts",
    "builtin_task",
    "extract_last_number",
    "format_question",
    "get_reward",
    "gsm8k_reward",
    "hold_out",
    "load_prompts",
]

RewardFn = Callable[[str, str | None], float]
"""A reward: `(response text, ground-truth answer or None) -> reward in [0, 1]`."""

INSTRUCTION = "Solve step by step and end with the final answer as a number."
"""Appended to the questions of prompt files (GSM8K): the reward reads the response's last number."""
ARITHMETIC_INSTRUCTION = "Answer with just the number."
"""Appended to the built-in task's questions: as accurate as `INSTRUCTION` for SmolLM2-135M at T = 1
(21% vs 20% on 128 one-digit problems) with shorter responses (31 vs 51 tokens on average)."""


@dataclass(frozen=True)
class Prompt:
    """One task prompt.

    Attributes:
        prompt_id: Unique id within its source (the JSONL `id` field, or `"{stem}-{line}"`).
        question: The question text shown to the model (without any instruction).
        answer: The ground-truth final answer, e.g. `"72"` (no `####`, no thousands commas),
            or None when unknown.
    """

    prompt_id: str
    question: str
    answer: str | None


class PromptFileError(ValueError):
    """A prompt file is missing, empty, or has a malformed line; the message names the file and line."""


# ---------------------------------------------------------------------------------------------
# Loading JSONL prompt files
# ---------------------------------------------------------------------------------------------


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Load prompts from a JSONL file, one JSON object per line.

    Each object needs `question` (or `prompt`): a non-empty string. Optional fields: `answer`
    (string or null; for GSM8K lines such as `"...reasoning...\\n#### 72"` only the text after the
    last `####` is kept, stripped and with thousands commas removed) and `id` (string or integer;
    default `"{file stem}-{line number}"`). Blank lines are skipped; line numbers are 1-based and
    count blank lines.

    Args:
        path: The JSONL file.
        limit: Stop after this many prompts (must be >= 1); None loads them all.

    Raises:
        PromptFileError: the file cannot be read or holds no prompts, or a line is not valid JSON,
            not an object, lacks a non-empty string question/prompt, has a non-string or empty
            answer, a bad `id`, or repeats an id. The message names the path and line number.
        ValueError: `limit` is not None and < 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be None or >= 1, got {limit!r}")
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PromptFileError(f"{path}: cannot read prompt file ({exc.strerror or exc})") from exc

    prompts: list[Prompt] = []
    first_line_of_id: dict[str, int] = {}
    for line_no, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        prompt = _parse_line(line, path, line_no)
        if prompt.prompt_id in first_line_of_id:
            raise PromptFileError(
                f"{path}:{line_no}: duplicate id {prompt.prompt_id!r} "
                f"(first seen on line {first_line_of_id[prompt.prompt_id]}); ids must be unique"
            )
        first_line_of_id[prompt.prompt_id] = line_no
        prompts.append(prompt)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise PromptFileError(f"{path}: no prompts found (expected JSONL lines with a 'question' field)")
    return prompts


def _parse_line(line: bytes, path: Path, line_no: int) -> Prompt:
    where = f"{path}:{line_no}"
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise PromptFileError(f"{where}: invalid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")

    key = "question" if "question" in obj else "prompt"
    question = obj.get(key)
    if not isinstance(question, str) or not question.strip():
        found = "missing" if key not in obj else f"{question!r}"
        raise PromptFileError(f"{where}: expected a non-empty string 'question' or 'prompt', got {found}")

    answer = obj.get("answer")
    if answer is not None:
        if not isinstance(answer, str):
            raise PromptFileError(f"{where}: expected 'answer' to be a string, got {answer!r}")
        answer = _final_answer(answer)
        if not answer:
            raise PromptFileError(f"{where}: 'answer' has no final answer (expected e.g. '#### 72' or '72')")

    prompt_id = obj.get("id", f"{path.stem}-{line_no}")
    if isinstance(prompt_id, int) and not isinstance(prompt_id, bool):
        prompt_id = str(prompt_id)
    if not isinstance(prompt_id, str) or not prompt_id:
        raise PromptFileError(
            f"{where}: expected 'id' to be a non-empty string or an integer, got {prompt_id!r}"
        )
    return Prompt(prompt_id=prompt_id, question=question, answer=answer)


def _final_answer(answer: str) -> str:
    """GSM8K answers end in `#### N`: keep N. Other answers are kept whole. Commas are dropped."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip().replace(",", "")


# ---------------------------------------------------------------------------------------------
# The built-in task: arithmetic on small integers
# ---------------------------------------------------------------------------------------------

OPERATORS = "+-*"
"""The operators the built-in task may use: addition, subtraction (never negative) and multiplication."""
MAX_DIGITS = 3
_ENUMERATE_BELOW = 50_000  # problem spaces up to this size are enumerated and shuffled; larger ones sampled
_EVAL_SPLIT_SEED = "specroll-arithmetic-eval"
"""Seeds the held-out evaluation set: fixed, so every run seed and every arm of a benchmark evaluates
on the same prompts."""

Problem = tuple[int, str, int]


@dataclass(frozen=True)
class TaskSplit:
    """A task's prompts: what training draws from and the held-out evaluation set (disjoint)."""

    train: list[Prompt]
    eval: list[Prompt]
    instruction: str = INSTRUCTION
    """Appended to every question by :func:`format_question`."""


def _check_arithmetic(digits: int, operators: str) -> None:
    if not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"digits={digits!r}, expected an integer in [1, {MAX_DIGITS}]")
    if not operators or any(op not in OPERATORS for op in operators) or len(set(operators)) != len(operators):
        raise ValueError(f"operators={operators!r}, expected distinct characters of {OPERATORS!r}")


def _operands(digits: int) -> range:
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def _space_size(digits: int, operators: str) -> int:
    k = len(_operands(digits))
    return sum(k * (k + 1) // 2 if op == "-" else k * k for op in operators)


def _draw(rng: random.Random, digits: int, operators: str) -> Problem:
    a, b = rng.choice(_operands(digits)), rng.choice(_operands(digits))
    op = rng.choice(operators)
    if op == "-" and b > a:
        a, b = b, a  # keep answers non-negative
    return a, op, b


def _problems(rng: random.Random, count: int, digits: int, operators: str, exclude: set[Problem]) -> list[Problem]:
    """``count`` distinct problems not in ``exclude`` (fewer when the space runs out), in ``rng``'s order."""
    if _space_size(digits, operators) <= _ENUMERATE_BELOW:
        ops = _operands(digits)
        space = [(a, op, b) for op in operators for a in ops for b in ops if op != "-" or a >= b]
        rng.shuffle(space)
        return [p for p in space if p not in exclude][:count]
    out: list[Problem] = []
    seen = set(exclude)
    while len(out) < count:  # the space is > 50k problems and count is a config value: this ends fast
        p = _draw(rng, digits, operators)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _prompt(problem: Problem) -> Prompt:
    a, op, b = problem
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return Prompt(prompt_id=f"arith-{a}{op}{b}", question=f"What is {a} {op} {b}?", answer=str(answer))


def builtin_task(count: int = 256, seed: int = 0, *, digits: int = 1, operators: str = OPERATORS,
                 eval_count: int = 64) -> TaskSplit:
    """The built-in task: "What is a op b?" with ``digits``-digit operands, split into a held-out
    evaluation set and training prompts that never include it.

    The difficulty knob is ``digits`` (and ``operators``): SmolLM2-135M-Instruct answers one-digit
    problems with ``+-*`` correctly about 20–30% of the time at temperature 1 (64 tokens, the
    last-number reward; 21% on 128 random problems, 31% on the held-out 64) but 77% of the held-out
    ones greedily — sampling at T = 1 is what RL sharpens — and two-digit ones far less often.

    The evaluation set depends only on ``(digits, operators, eval_count)`` — the same for every
    run seed, so runs and benchmark arms are evaluated on the same prompts; the training prompts are
    the first ``count`` of the remaining problems in an order shuffled by ``seed`` (fewer when the
    space is smaller: one-digit problems with ``+-*`` number 255). Subtraction never goes below 0.
    Prompt ids are ``"arith-{a}{op}{b}"``; answers are decimal strings.

    Raises:
        ValueError: ``count`` < 1, ``eval_count`` < 0, ``digits`` outside [1, 3], ``operators`` not
            distinct characters of ``"+-*"``, or no problem left for training after the held-out set.
    """
    _check_arithmetic(digits, operators)
    if count < 1 or eval_count < 0:
        raise ValueError(f"count={count!r}, eval_count={eval_count!r}; expected count >= 1 and eval_count >= 0")
    held_out = _problems(random.Random(f"{_EVAL_SPLIT_SEED}-{digits}-{operators}"), eval_count, digits, operators,
                         set())
    train = _problems(random.Random(seed), count, digits, operators, set(held_out))
    if not train:
        raise ValueError(f"{digits}-digit problems with {operators!r} number {_space_size(digits, operators)}; "
                         f"none is left for training after {eval_count} held out (lower eval.count)")
    return TaskSplit(train=[_prompt(p) for p in train], eval=[_prompt(p) for p in held_out],
                     instruction=ARITHMETIC_INSTRUCTION)


def builtin_prompts(count: int = 32, seed: int = 0) -> list[Prompt]:
    """``count`` training prompts of the default built-in task (:func:`builtin_task` with one-digit
    operands and ``+-*``, the default held-out set excluded), in ``seed``'s order.

    Raises:
        ValueError: ``count`` < 1.
    """
    return builtin_task(count, seed).train


def hold_out(prompts: list[Prompt], count: int) -> TaskSplit:
    """Split a prompt file's prompts: the last ``count`` are the evaluation set, never trained on.

    Raises:
        ValueError: ``count`` < 0, or not at least one prompt left for training.
    """
    if count < 0 or count >= len(prompts):
        raise ValueError(f"cannot hold out {count} of {len(prompts)} prompts for evaluation and still train "
                         "(expected 0 <= eval.count < the number of prompts)")
    return TaskSplit(train=prompts[: len(prompts) - count], eval=prompts[len(prompts) - count:])


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

# An optional sign not glued to a preceding word/number ("3-4" is not -4), an optional "$", then
# either comma-grouped thousands ("1,234") or plain digits, then an optional decimal part (a bare
# trailing "." as in "72." is a full stop, not a decimal point).
_NUMBER = re.compile(r"(?<![\w.])(-?)\$?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")


def extract_last_number(text: str) -> str | None:
    """Return the last number in `text`, normalised, or None when there is none.

    Understands thousands commas (`1,234`), signs (`-5`), decimals (`3.50`) and currency (`$5`).
    Normalisation drops commas and trailing fractional zeros, so `"72.0"`, `"72.00"`, `"$72"` and
    `"72"` all give `"72"`, and `"3.50"` gives `"3.5"`. Digits glued to letters (`x2`) are ignored.
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    sign, integer, fraction = matches[-1]
    return _normalise(f"{sign}{integer.replace(',', '')}{fraction or ''}")


def _normalise(number: str) -> str:
    value = Decimal(number)
    if value == value.to_integral_value():
        return str(int(value))  # also turns "-0" into "0"
    return format(value.normalize(), "f")


def gsm8k_reward(response: str, answer: str | None) -> float:
    """GSM8K correctness: last number in the response vs the `#### N` answer.

    Returns 1.0 when the last number in `response` (see `extract_last_number`) equals `answer`
    numerically (`"72.00"` matches `"72"`, `"$1,000."` matches `"1000"`), else 0.0. Returns 0.0
    when `answer` is None or has no number in it.
    """
    if answer is None:
        return 0.0
    expected = extract_last_number(answer)
    got = extract_last_number(response)
    return 1.0 if expected is not None and got == expected else 0.0


REWARDS: dict[str, RewardFn] = {"gsm8k": gsm8k_reward}
"""Reward functions by name, as named in configs."""


def get_reward(name: str) -> RewardFn:
    """Return the reward function registered as `name` in `REWARDS`.

    Raises:
        ValueError: `name` is not a known reward; the message lists the known names.
    """
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; expected one of {sorted(REWARDS)}") from None


def format_question(question: str, instruction: str = INSTRUCTION) -> list[dict[str, str]]:
    """Chat messages for the model: one user turn with the question and a short answer-format hint.

    The hint (``instruction``: a task's :attr:`TaskSplit.instruction`) asks for a final number so
    that `gsm8k_reward` can find it; it is kept short because the default model
    (SmolLM2-135M-Instruct) follows long instructions poorly.
    """
    return [{"role": "user", "content": f"{question}\n\n{instruction}"}]
