"""Prompt sources and rewards for RL rollouts: GSM8K-style JSONL files, a built-in arithmetic task,
and the "last number in the response" reward.

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
    "REWARDS",
    "Prompt",
    "PromptFileError",
    "RewardFn",
    "builtin_prompts",
    "extract_last_number",
    "format_question",
    "get_reward",
    "gsm8k_reward",
    "load_prompts",
]

RewardFn = Callable[[str, str | None], float]
"""A reward: `(response text, ground-truth answer or None) -> reward in [0, 1]`."""

INSTRUCTION = "Solve step by step and end with the final answer as a number."


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
# Built-in arithmetic word problems
# ---------------------------------------------------------------------------------------------

_NAMES = ("Maria", "James", "Aisha", "Tom", "Lena", "Carlos", "Priya", "Ben", "Sofia", "Omar")
_ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "cards")


def _shopping(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(_NAMES)
    a, p, b, q = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 6)
    total = a * p + b * q
    bill = (total // 10 + 1) * 10 + rng.choice((0, 10, 20))  # a round bill strictly above the total
    question = (
        f"{name} buys {a} notebooks that cost ${p} each and {b} pens that cost ${q} each. "
        f"{name} pays with a ${bill} bill. How much change, in dollars, does {name} get back?"
    )
    return question, bill - total


def _sharing(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    friends, each, kept = rng.randint(2, 8), rng.randint(2, 9), rng.randint(1, 20)
    total = friends * each + kept
    question = (
        f"{name} has {total} {item}. {name} gives {each} {item} to each of {friends} friends "
        f"and keeps the rest. How many {item} does {name} keep?"
    )
    return question, kept


def _speed_time(rng: random.Random) -> tuple[str, int]:
    s1, h1, s2, h2 = rng.randint(20, 80), rng.randint(2, 6), rng.randint(20, 80), rng.randint(1, 5)
    question = (
        f"A train travels at {s1} miles per hour for {h1} hours, and then at {s2} miles per hour "
        f"for {h2} hours. How many miles does the train travel in total?"
    )
    return question, s1 * h1 + s2 * h2


def _ages(rng: random.Random) -> tuple[str, int]:
    older, younger = rng.sample(_NAMES, 2)
    gap, years = rng.randint(2, 15), rng.randint(2, 10)
    future_age = years + rng.randint(3, 40)  # the younger one is at least 3 now
    question = (
        f"{older} is {gap} years older than {younger}. In {years} years, {younger} will be "
        f"{future_age} years old. How old is {older} now?"
    )
    return question, future_age - years + gap


def _bakery(rng: random.Random) -> tuple[str, int]:
    trays, per_tray = rng.randint(3, 12), rng.randint(6, 24)
    baked = trays * per_tray
    morning = rng.randint(1, baked // 2)
    afternoon = rng.randint(1, baked - morning)
    question = (
        f"A bakery makes {trays} trays of cookies with {per_tray} cookies on each tray. It sells "
        f"{morning} cookies in the morning and {afternoon} cookies in the afternoon. "
        f"How many cookies are left?"
    )
    return question, baked - morning - afternoon


def _savings(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(_NAMES)
    wage, weeks = rng.randint(10, 60), rng.randint(3, 12)
    spent = rng.randint(5, min(40, wage * weeks - 1))  # leaves a positive amount to double
    question = (
        f"{name} earns ${wage} every week for {weeks} weeks. Then {name} spends ${spent} on a gift "
        f"and doubles the money that is left. How many dollars does {name} have now?"
    )
    return question, 2 * (wage * weeks - spent)


_TEMPLATES: tuple[Callable[[random.Random], tuple[str, int]], ...] = (
    _shopping,
    _sharing,
    _speed_time,
    _ages,
    _bakery,
    _savings,
)


def builtin_prompts(count: int = 32, seed: int = 0) -> list[Prompt]:
    """Generate `count` GSM8K-style arithmetic word problems with exact integer answers.

    Templates: shopping (change from a bill), sharing items, speed x time over two legs, ages,
    a multi-step bakery count, and earn/spend/double savings. The templates are cycled in an
    order shuffled by `seed`, so any 6 consecutive prompts cover all of them. The same
    `(count, seed)` always gives the same prompts; ids are `"builtin-{seed}-{index}"`. All answers
    are non-negative integers, stored as decimal strings.

    Raises:
        ValueError: `count` < 0.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count!r}")
    rng = random.Random(seed)
    order = list(_TEMPLATES)
    rng.shuffle(order)
    prompts = []
    for index in range(count):
        question, answer = order[index % len(order)](rng)
        assert answer >= 0, (question, answer)
        prompts.append(Prompt(prompt_id=f"builtin-{seed}-{index}", question=question, answer=str(answer)))
    return prompts


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


def format_question(question: str) -> list[dict[str, str]]:
    """Chat messages for the model: one user turn with the question and a short answer-format hint.

    The hint asks for a final number so that `gsm8k_reward` can find it; it is kept short because
    the default model (SmolLM2-135M-Instruct) follows long instructions poorly.
    """
    return [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}]
