"""Tests for prompt loading, the built-in arithmetic task and the GSM8K reward."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specroll.rl.tasks import (
    REWARDS,
    Prompt,
    PromptFileError,
    builtin_prompts,
    extract_last_number,
    format_question,
    get_reward,
    gsm8k_reward,
    load_prompts,
)

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def _write(tmp_path: Path, lines: list[str], name: str = "probs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------- load_prompts


def test_load_gsm8k_shaped_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps(
                {
                    "question": "Janet has 16 eggs and eats 3. How many are left?",
                    "answer": "She has 16 - 3 = <<16-3=13>>13 left.\n#### 13",
                }
            ),
            "",  # blank lines are skipped but still counted
            json.dumps(
                {"question": "How many cents in 12 dollars?", "answer": "12 * 100 = 1,200\n#### 1,200 "}
            ),
            json.dumps({"prompt": "Say hi.", "id": "greet"}),
            json.dumps({"question": "What is 2+2?", "answer": "4", "id": 7}),
        ],
    )
    prompts = load_prompts(path)
    assert prompts == [
        Prompt("probs-1", "Janet has 16 eggs and eats 3. How many are left?", "13"),
        Prompt("probs-3", "How many cents in 12 dollars?", "1200"),
        Prompt("greet", "Say hi.", None),
        Prompt("7", "What is 2+2?", "4"),
    ]
    assert load_prompts(str(path), limit=2) == prompts[:2]


def test_load_real_gsm8k_first_20_lines(tmp_path: Path) -> None:
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} not present on this machine")
    with GSM8K_TEST.open(encoding="utf-8") as f:
        lines = [next(f) for _ in range(20)]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    prompts = load_prompts(path)
    assert len(prompts) == 20
    assert prompts[0].prompt_id == "test-1" and prompts[19].prompt_id == "test-20"
    for line, prompt in zip(lines, prompts, strict=True):
        row = json.loads(line)
        assert prompt.question == row["question"]
        assert prompt.answer == row["answer"].split("####")[-1].strip().replace(",", "")
        assert re.fullmatch(r"-?\d+(\.\d+)?", prompt.answer), prompt.answer
        # The reference solution's last number is its final answer, so it earns full reward.
        assert gsm8k_reward(row["answer"], prompt.answer) == 1.0
    # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2 each.
    assert prompts[0].answer == "18"
    assert load_prompts(GSM8K_TEST, limit=20) == [
        Prompt(f"test-{i}", p.question, p.answer) for i, p in enumerate(prompts, start=1)
    ]


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"answer": "#### 3"}', "question"),
        ('{"question": ""}', "non-empty string"),
        ('{"question": "   "}', "non-empty string"),
        ('{"question": 42}', "42"),
        ('{"prompt": null}', "non-empty string"),
        ('{"question": "q?", "answer": 3}', "'answer' to be a string"),
        ('{"question": "q?", "answer": "reasoning\\n#### "}', "no final answer"),
        ('{"question": "q?", "id": 1.5}', "'id'"),
        ('{"question": "q?", "id": "probs-1"}', "duplicate id"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, expected: str) -> None:
    good = json.dumps({"question": "What is 1+1?", "answer": "#### 2"})
    path = _write(tmp_path, [good, "", good, bad_line, good])
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    message = str(info.value)
    assert f"{path}:4:" in message
    assert expected in message


def test_missing_and_empty_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(PromptFileError, match=re.escape(str(missing))):
        load_prompts(missing)
    empty = _write(tmp_path, ["", "   "], name="empty.jsonl")
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompts(empty)
    assert issubclass(PromptFileError, ValueError)
    with pytest.raises(ValueError, match="limit"):
        load_prompts(empty, limit=0)


# ---------------------------------------------------------------------------- builtin_prompts


def _recompute(question: str) -> int:
    """Solve a built-in question independently, from the numbers in its text."""
    n = [int(x) for x in re.findall(r"\d+", question)]
    if "notebooks" in question:  # a notebooks at $p, b pens at $q, pay with a bill
        a, p, b, q, bill = n
        return bill - a * p - b * q
    if "friends" in question:  # total items, `each` to each of `friends`, keep the rest
        total, each, friends = n
        return total - each * friends
    if "miles per hour" in question:
        s1, h1, s2, h2 = n
        return s1 * h1 + s2 * h2
    if "years older" in question:  # gap, in `years` years the younger will be `future`
        gap, years, future = n
        return future - years + gap
    if "trays" in question:
        trays, per_tray, morning, afternoon = n
        return trays * per_tray - morning - afternoon
    if "earns" in question:
        wage, weeks, spent = n
        return 2 * (wage * weeks - spent)
    raise AssertionError(f"unrecognised built-in question: {question}")


def test_builtin_prompts_answers_are_correct() -> None:
    for seed, count in [(0, 24), (1, 24), (2, 24), (3, 24), (4, 2000)]:  # a large set meets rare draws
        prompts = builtin_prompts(count=count, seed=seed)
        assert len(prompts) == count
        assert len({p.prompt_id for p in prompts}) == count
        for prompt in prompts:
            assert prompt.answer == str(_recompute(prompt.question)), prompt
            assert int(prompt.answer) >= 0
            assert prompt.question.endswith("?")
            assert gsm8k_reward(f"So the answer is {prompt.answer}.", prompt.answer) == 1.0


def test_builtin_prompts_hand_checked_and_cover_all_templates() -> None:
    # Hand-checked: 9 trays x 15 = 135 cookies, 135 - 62 - 46 = 27.
    first = builtin_prompts(count=1, seed=0)[0]
    assert "9 trays" in first.question and "15 cookies" in first.question
    assert "62 cookies" in first.question and "46 cookies" in first.question
    assert first.answer == "27"
    keywords = ("notebooks", "friends", "miles per hour", "years older", "trays", "earns")
    prompts = builtin_prompts(count=6, seed=3)
    assert all(any(k in p.question for p in prompts) for k in keywords)


def test_builtin_prompts_deterministic_per_seed() -> None:
    assert builtin_prompts(count=16, seed=1) == builtin_prompts(count=16, seed=1)
    assert builtin_prompts(count=8, seed=1) == builtin_prompts(count=16, seed=1)[:8]
    questions = {seed: [p.question for p in builtin_prompts(count=16, seed=seed)] for seed in range(4)}
    assert len({tuple(q) for q in questions.values()}) == 4
    assert builtin_prompts(count=0) == []
    with pytest.raises(ValueError, match="-1"):
        builtin_prompts(count=-1)


# ------------------------------------------------------------------------------------ rewards


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 72.", "72"),
        ("So she pays $1,000.", "1000"),
        ("1,234,567 people", "1234567"),
        ("It is 72.0", "72"),
        ("It is 72.00 exactly", "72"),
        ("It costs $3.50 each", "3.5"),
        ("The temperature is -5 degrees", "-5"),
        ("She lost -$5.", "-5"),
        ("16-3-4=9", "9"),
        ("The total is 10-3", "3"),  # subtraction, not a negative number
        ("first 3, then 10", "10"),
        ("a change of -0.0", "0"),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("5 + 7 = 12, so the total is 1,000.", "1000", 1.0),
        ("The answer is $1,000.", "1000", 1.0),
        ("Final answer: 72.", "72", 1.0),
        ("Final answer: 72.00", "72", 1.0),
        ("He is down -3 points.", "-3", 1.0),
        ("He is down 3 points.", "-3", 0.0),
        ("The price is 2.5 dollars.", "2.50", 1.0),
        ("72 at first, but then 73", "72", 0.0),
        ("I do not know.", "72", 0.0),
        ("The answer is 72.", None, 0.0),
        ("No number here.", "unknown", 0.0),
    ],
)
def test_gsm8k_reward(response: str, answer: str | None, reward: float) -> None:
    assert gsm8k_reward(response, answer) == reward


def test_get_reward_and_format_question() -> None:
    assert get_reward("gsm8k") is gsm8k_reward is REWARDS["gsm8k"]
    with pytest.raises(ValueError, match=r"'nope'.*'gsm8k'"):
        get_reward("nope")
    messages = format_question("What is 2+2?")
    assert len(messages) == 1
    assert messages[0]["role"] == "user"
    assert messages[0]["content"].startswith("What is 2+2?")
    assert "final answer" in messages[0]["content"]
