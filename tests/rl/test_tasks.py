"""Tests for prompt loading, the built-in arithmetic task and the GSM8K reward."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specroll.rl.tasks import (
    ARITHMETIC_INSTRUCTION,
    REWARDS,
    Prompt,
    PromptFileError,
    builtin_prompts,
    builtin_task,
    extract_last_number,
    format_question,
    get_reward,
    gsm8k_reward,
    hold_out,
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


# ------------------------------------------------------------------------------- builtin task


def _solve(question: str) -> int:
    """Solve a built-in question independently, from its text."""
    m = re.fullmatch(r"What is (\d+) ([+*-]) (\d+)\?", question)
    assert m is not None, question
    a, op, b = int(m[1]), m[2], int(m[3])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_builtin_task_answers_are_correct_and_splits_are_disjoint(digits: int) -> None:
    split = builtin_task(count=500, seed=3, digits=digits, eval_count=64)
    assert len(split.eval) == 64
    assert len(split.train) == (255 - 64 if digits == 1 else 500)  # one-digit +-* problems number 255
    for prompt in split.train + split.eval:
        assert prompt.answer == str(_solve(prompt.question)), prompt
        assert int(prompt.answer) >= 0
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        assert all(lo <= int(x) < 10**digits for x in re.findall(r"\d+", prompt.question))
        assert gsm8k_reward(f"So the answer is {prompt.answer}.", prompt.answer) == 1.0
    ids = [p.prompt_id for p in split.train + split.eval]
    assert len(set(ids)) == len(ids)  # distinct problems, and no evaluation prompt is ever trained on
    assert split.instruction == ARITHMETIC_INSTRUCTION


def test_builtin_task_is_deterministic_and_the_eval_set_is_the_same_for_every_seed() -> None:
    a, b = builtin_task(count=32, seed=1), builtin_task(count=32, seed=1)
    assert a == b
    assert builtin_task(count=8, seed=1).train == a.train[:8]
    # Pinned (a change of order changes every run): the first prompts for seed 1, the held-out set's first.
    assert [p.prompt_id for p in a.train[:3]] == ["arith-7*7", "arith-6+6", "arith-2*7"]
    assert (a.train[0].question, a.train[0].answer) == ("What is 7 * 7?", "49")
    assert [p.prompt_id for p in a.eval[:2]] == ["arith-4+3", "arith-5-0"]
    others = [builtin_task(count=32, seed=seed) for seed in range(4)]
    assert all(o.eval == a.eval for o in others)  # every run seed evaluates on the same prompts
    assert len({tuple(p.prompt_id for p in o.train) for o in others}) == 4  # but trains in its own order
    assert builtin_task(count=16, seed=0, operators="+").eval != a.eval  # the set follows the task
    assert all("+" in p.question for p in builtin_task(count=16, seed=0, operators="+").train)
    assert builtin_prompts(count=16, seed=2) == builtin_task(count=16, seed=2).train


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"count": 0}, "count=0"),
    ({"eval_count": -1}, "eval_count=-1"),
    ({"digits": 4}, "digits=4"),
    ({"operators": "+/"}, "operators='\\+/'"),
    ({"operators": "++"}, "operators='\\+\\+'"),
    ({"eval_count": 255}, "lower eval.count"),
])
def test_builtin_task_refuses_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        builtin_task(**kwargs)


def test_hold_out_keeps_the_last_prompts_for_evaluation() -> None:
    prompts = [Prompt(prompt_id=str(i), question=f"q{i}", answer=str(i)) for i in range(10)]
    split = hold_out(prompts, 3)
    assert [p.prompt_id for p in split.train] == [str(i) for i in range(7)]
    assert [p.prompt_id for p in split.eval] == ["7", "8", "9"]
    with pytest.raises(ValueError, match="cannot hold out 10 of 10"):
        hold_out(prompts, 10)


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
