"""``specroll generate`` as a real subprocess on tiny checkpoints: the JSONL it writes, and how it
fails on bad input (non-zero exit, one error line naming the problem, no traceback, no output).

Every run is started once, concurrently, by the module fixture ``runs`` (a Python start with torch
costs ~2 s on the 2-core CI machine); each test then checks one run. Most bad inputs run the CLI's
entry point in this process instead (``IN_A_PROCESS`` says which do not, and why).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import write_tiny_checkpoint
from helpers.gsm8k_lines import GSM8K_LINES
from helpers.timeouts import guard
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specroll.rl.tasks import extract_last_number, format_question, gsm8k_reward

SPECROLL = Path(sys.executable).with_name("specroll")  # the console script beside the venv's python
RECORD_FIELDS = {
    "prompt_id", "sample_index", "prompt", "response", "prompt_token_ids", "token_ids", "logprobs", "versions",
    "finish_reason", "answer", "reward",
}
N, MAX_TOKENS = 4, 24
TEMPERATURE, TOP_K, TOP_P = 1.0, 50, 0.95


@dataclass(frozen=True)
class Run:
    args: list[str]
    out: Path
    rc: int
    stdout: str
    stderr: str


def _run(argv: list[str], out: Path) -> Run:
    # One intra-op thread each: the runs share the machine's cores.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TQDM")}, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=guard(300), env=env)
    return Run(argv, out, p.returncode, p.stdout, p.stderr)


# What a process would print beside the CLI's own output, and this process does not: the warnings a
# default interpreter shows and the log records Python's last-resort handler writes to stderr.
_HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def _run_in_process(argv: list[str], out: Path, capfd: pytest.CaptureFixture[str]) -> Run:
    """``specroll ARGV`` through ``specroll.actors.cli.main`` here: its exit code (argparse's
    ``SystemExit`` too), what it wrote to stdout and stderr, and, as stderr lines, any warning or log
    record of WARNING and above it raised (what the same run as a process would print)."""
    from specroll.actors.cli import main

    capfd.readouterr()
    records = io.StringIO()
    handler = logging.StreamHandler(records)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                rc = main(argv)
            except SystemExit as exit_:  # argparse's usage errors
                rc = exit_.code
    finally:
        logging.getLogger().removeHandler(handler)
    captured = capfd.readouterr()
    shown = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
             for w in caught if not issubclass(w.category, _HIDDEN_WARNINGS)]
    return Run(argv, out, rc, captured.out, captured.err + "".join(shown) + records.getvalue())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    for name, overrides in (("tiny", {}), ("short", {"max_position_embeddings": 32})):
        (d / name).mkdir()
        write_tiny_checkpoint(d / name, "llama", **overrides)
    (d / "gsm8k.jsonl").write_text("".join(json.dumps(line) + "\n" for line in GSM8K_LINES))
    (d / "bad.jsonl").write_text(json.dumps(GSM8K_LINES[0]) + "\n\n" + '{"question": "How many' + "\n")
    (d / "empty_dir").mkdir()
    shutil.copytree(d / "tiny", d / "gpt2")
    config = json.loads((d / "gpt2" / "config.json").read_text())
    (d / "gpt2" / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    (d / "corrupt.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 40)
    (d / "existing").mkdir()
    (d / "existing" / "rollouts.jsonl").write_bytes(b'{"old": "rollouts"}\n')
    (d / "out_is_dir").mkdir()
    from specroll.drafter.eagle_config import EagleConfig
    from specroll.drafter.eagle_head import EagleHead

    other = EagleConfig(400, 64, 128, 4, 2, 16, 1e-5, 10000.0, (2,), 100, 2)  # made for a 400-token vocabulary
    EagleHead.init(other, torch.arange(100)).save(d / "drafter_other")
    return d


# name → (arguments after `generate`, regex the error line must match, an argparse usage error).
BAD: dict[str, tuple[list[str], str, bool]] = {
    "missing_checkpoint": (["--model", "{w}/no-such-model"], r"'[^']*/no-such-model' is neither an existing", False),
    "no_config_json": (["--model", "{w}/empty_dir"], r"empty_dir: no config\.json", False),
    "unsupported_architecture": (["--model", "{w}/gpt2"], r"unsupported architecture 'GPT2LMHeadModel'", False),
    "corrupt_gguf": (["--model", "{w}/corrupt.gguf"], r"corrupt\.gguf: not a readable GGUF file", False),
    "prompt_longer_than_context": (["--model", "{w}/short"],
                                   r"prompt 'gsm8k-1' has \d+ tokens .*context holds 32", False),
    "n_zero": (["--n", "0"], r"argument --n: 0 is not a positive integer", True),
    "max_tokens_zero": (["--max-tokens", "0"], r"argument --max-tokens: 0 is not a positive integer", True),
    "malformed_jsonl": (["--prompts", "{w}/bad.jsonl"], r"bad\.jsonl:3: invalid JSON", False),
    "missing_prompts_file": (["--prompts", "{w}/nope.jsonl"], r"nope\.jsonl: cannot read prompt file", False),
    "negative_temperature": (["--temperature", "-0.5"], r"temperature=-0\.5, expected a number >= 0", False),
    "top_p_zero": (["--top-p", "0"], r"top_p=0\.0, expected a number in \(0, 1\]", False),
    "kv_cache_too_small": (["--kv-cache-gb", "1e-9"], r"kv_cache_memory_gb=1e-09 holds 0 pages", False),
    "unknown_device": (["--device", "gpu0"], r"gpu0", False),
    "out_is_a_directory": (["--out", "{w}/out_is_dir"], r"out_is_dir", False),
    "eagle_without_drafter": (["--speculative", "eagle"], r"--speculative eagle needs --drafter", False),
    "drafter_with_suffix": (["--speculative", "suffix", "--drafter", "{w}/drafter_other"],
                            r"--drafter .* is used only with --speculative eagle, tree or auto", False),
    "tree_without_drafter": (["--speculative", "tree"], r"--speculative tree needs --drafter", False),
    "bad_tree_shape": (["--speculative", "tree", "--drafter", "{w}/drafter_other", "--draft-trees", "4x4"],
                       r"tree shape '4x4': expected DEPTHxWIDTH:NODES", False),
    "drafter_for_another_vocabulary": (["--speculative", "eagle", "--drafter", "{w}/drafter_other"],
                                       r"drafter_other was made for a target with vocabulary 400, .*vocabulary 320",
                                       False),
    "drafter_missing": (["--speculative", "auto", "--drafter", "{w}/no_drafter"], r"no_drafter: does not exist", False),
    "num_draft_tokens_zero": (["--num-draft-tokens", "0"], r"--num-draft-tokens: 0 is not a positive", True),
}
if not torch.cuda.is_available():
    BAD["cuda_device_without_cuda"] = (["--device", "cuda"], r"(?i)cuda", False)
IN_A_PROCESS = {"missing_checkpoint", *(name for name, (_, _, usage) in BAD.items() if usage)}
"""The bad inputs run as real processes (the ``runs`` fixture): argparse's usage errors, refused before
torch is imported (~0.1 s a process), and one refused at load, the proof of a real process's exit code
and single stderr line. The rest run ``cli.main`` in this process (no process start with torch, ~3
CPU-s each): each is refused before any generation, and none changes the process's state (no
``--threads``, no logging set up) — ``keeps_existing``, refused after its engine is built, stays a process."""


def _generate_args(w: Path, name: str, extra: list[str]) -> tuple[list[str], Path]:
    out = w / "out" / name / "rollouts.jsonl"
    base = {"--model": str(w / "tiny"), "--prompts": str(w / "gsm8k.jsonl"), "--n": "2", "--max-tokens": "4",
            "--out": str(out)}
    extra = [a.replace("{w}", str(w)) for a in extra]
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        base[flag] = value
    args = [x for kv in base.items() for x in kv] + ["--no-progress"]
    return args, Path(base["--out"])


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Run]:
    w = work
    jobs: dict[str, tuple[list[str], Path]] = {}
    for name in IN_A_PROCESS:
        args, out = _generate_args(w, name, BAD[name][0])
        jobs[name] = ([sys.executable, "-m", "specroll.actors.cli", "generate", *args], out)
    jobs["gsm8k"] = _gsm8k_job(w, "gsm8k")
    greedy = ["generate", "--dtype", "float32", "--model", str(w / "tiny"),
              "--limit", "2", "--num-builtin", "3", "--n", "2",
              "--max-tokens", "12", "--temperature", "0", "--reward", "none", "--no-progress"]
    drafter = w / "drafter_tiny"
    made = _run([str(SPECROLL), "init-drafter", "--model", str(w / "tiny"), "--out", str(drafter),
                 "--draft-vocab-size", "300", "--num-builtin", "8"], drafter)
    assert made.rc == 0, made.stderr
    speculative = (("greedy_suffix", ["--speculative", "suffix"]),
                   ("greedy_eagle", ["--speculative", "eagle", "--drafter", str(drafter)]),
                   ("greedy_auto", ["--speculative", "auto", "--drafter", str(drafter), "--num-draft-tokens", "3"]),
                   ("greedy_tree", ["--speculative", "tree", "--drafter", str(drafter), "--draft-trees", "3x3:8"]))
    for name, extra in (("greedy", []), ("greedy_chunked", ["--max-num-batched-tokens", "8"]), *speculative):
        out = w / "out" / name / "rollouts.jsonl"
        jobs[name] = ([sys.executable, "-m", "specroll.actors.cli", *greedy, *extra, "--out", str(out)], out)
    # A run that fails after the engine is built, over an existing output file.
    existing = w / "existing" / "rollouts.jsonl"
    jobs["keeps_existing"] = ([sys.executable, "-m", "specroll.actors.cli", "generate", "--model", str(w / "short"),
                               "--prompts", str(w / "gsm8k.jsonl"), "--out", str(existing), "--no-progress"], existing)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_run, argv, out) for name, (argv, out) in jobs.items()}
        # Same command and seed again, each prompt's answer now the last number of one of its
        # responses from the first run, so that some rollouts earn reward 1.
        first_run = futures["gsm8k"].result()
        first = read_records(first_run.out) if first_run.rc == 0 else []  # else its own test reports it
        lines = [dict(line) for line in GSM8K_LINES]
        for j, line in enumerate(lines):
            numbers = [n for r in first[j * N : (j + 1) * N] if (n := extract_last_number(r["response"]))]
            if numbers:
                line["answer"] = f"#### {numbers[0]}"
        (w / "gsm8k_rewarded.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        futures["gsm8k_rewarded"] = pool.submit(_run, *_gsm8k_job(w, "gsm8k_rewarded"))
        return {name: f.result() for name, f in futures.items()}


def _gsm8k_job(w: Path, name: str) -> tuple[list[str], Path]:
    out = w / "out" / name / "rollouts.jsonl"
    argv = [str(SPECROLL), "generate", "--dtype", "float32", "--model", str(w / "tiny"),
            "--prompts", str(w / f"{name}.jsonl"),
            "--n", str(N), "--max-tokens", str(MAX_TOKENS), "--temperature", str(TEMPERATURE), "--top-k",
            str(TOP_K), "--top-p", str(TOP_P), "--seed", "7", "--reward", "gsm8k", "--out", str(out),
            "--no-progress"]
    return argv, out


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_clean_failure(run: Run, match: str, usage: bool) -> None:
    assert run.rc != 0, f"exit 0 for bad input {run.args}"
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith("specroll generate: error: "), run.stderr
    assert re.search(match, errors[0]), errors[0]
    if not usage:
        assert lines == errors, f"more than the error line on stderr: {run.stderr!r}"
    assert run.stdout == ""


@pytest.mark.parametrize("name", [name for name in BAD if name not in IN_A_PROCESS])
def test_bad_input_fails_cleanly_and_writes_nothing(work: Path, capfd: pytest.CaptureFixture[str], name: str) -> None:
    args, out = _generate_args(work, name, BAD[name][0])
    assert_bad_input_refused(_run_in_process(["generate", *args], out, capfd), name)


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(IN_A_PROCESS))
def test_a_bad_input_process_fails_cleanly_and_writes_nothing(runs: dict[str, Run], name: str) -> None:
    assert_bad_input_refused(runs[name], name)


def assert_bad_input_refused(run: Run, name: str) -> None:
    _, match, usage = BAD[name]
    assert_clean_failure(run, match, usage)
    if name == "out_is_a_directory":
        assert list(run.out.iterdir()) == []
        leftovers = [p.name for p in run.out.parent.iterdir() if p.name.endswith(".tmp")]
        assert leftovers == [], leftovers
    else:
        # Neither the output file nor a temporary file beside it.
        assert not run.out.parent.exists() or list(run.out.parent.iterdir()) == []


@pytest.mark.integration
def test_failed_run_leaves_an_existing_output_untouched(runs: dict[str, Run]) -> None:
    run = runs["keeps_existing"]
    assert_clean_failure(run, r"context holds 32", usage=False)
    assert run.out.read_bytes() == b'{"old": "rollouts"}\n'
    assert sorted(p.name for p in run.out.parent.iterdir()) == ["rollouts.jsonl"]


@pytest.mark.integration
def test_generate_writes_gsm8k_rollouts(runs: dict[str, Run], work: Path) -> None:
    run = runs["gsm8k"]
    assert run.rc == 0, run.stderr
    assert "Traceback" not in run.stderr
    records = read_records(run.out)
    assert len(records) == len(GSM8K_LINES) * N
    assert f"{len(records)} rollouts" in run.stdout and str(run.out) in run.stdout
    assert [p.name for p in run.out.parent.iterdir()] == ["rollouts.jsonl"]  # no temporary file left

    tokenizer = AutoTokenizer.from_pretrained(work / "tiny")
    reference = AutoModelForCausalLM.from_pretrained(work / "tiny", dtype=torch.float32).eval()
    ids, answers = ["gsm8k-1", "gsm8k-2", "big"], ["72", "10", "1851"]
    for r in records:
        assert set(r) == RECORD_FIELDS
    for j, (line, prompt_id, answer) in enumerate(zip(GSM8K_LINES, ids, answers, strict=True)):
        group = records[j * N : (j + 1) * N]
        assert [r["prompt_id"] for r in group] == [prompt_id] * N
        assert [r["sample_index"] for r in group] == list(range(N))
        expected_prompt = tokenizer.apply_chat_template(format_question(line["question"]), add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
        assert len({tuple(r["token_ids"]) for r in group}) > 1, "the n samples of a prompt should differ"
        for r in group:
            assert r["prompt"] == line["question"] and r["answer"] == answer
            assert r["prompt_token_ids"] == list(expected_prompt)
            n = len(r["token_ids"])
            assert 1 <= n <= MAX_TOKENS and len(r["logprobs"]) == len(r["versions"]) == n
            assert r["versions"] == [0] * n
            assert all(math.isfinite(lp) and lp <= 0 for lp in r["logprobs"])
            if r["finish_reason"] == "length":
                assert n == MAX_TOKENS
            else:
                assert r["finish_reason"] == "stop" and r["token_ids"][-1] in (tokenizer.eos_token_id,)
            assert r["response"] == tokenizer.decode(r["token_ids"], skip_special_tokens=True)
            assert r["reward"] == gsm8k_reward(r["response"], answer)
            # The logprobs are those of the written tokens under --temperature/--top-k/--top-p.
            with torch.no_grad():
                logits = reference(torch.tensor([r["prompt_token_ids"] + r["token_ids"]])).logits[0]
            scores = logits[len(r["prompt_token_ids"]) - 1 : -1].double()
            for warper in (TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K), TopPLogitsWarper(TOP_P)):
                scores = warper(None, scores)
            expected = scores.log_softmax(-1).gather(-1, torch.tensor(r["token_ids"])[:, None]).squeeze(-1)
            assert (torch.tensor(r["logprobs"], dtype=torch.float64) - expected).abs().max().item() <= 1e-4
    mean = sum(r["reward"] for r in records) / len(records)
    assert f"mean reward {mean:.3f}" in run.stdout


@pytest.mark.integration
def test_rewards_follow_the_answers(runs: dict[str, Run], work: Path) -> None:
    first, run = read_records(runs["gsm8k"].out), runs["gsm8k_rewarded"]
    assert run.rc == 0, run.stderr
    records = read_records(run.out)
    # Seeded: the same command gives the same rollouts; only answers and rewards changed.
    assert [r["token_ids"] for r in records] == [r["token_ids"] for r in first]
    answers = [json.loads(line)["answer"].split("####")[-1].strip().replace(",", "")
               for line in (work / "gsm8k_rewarded.jsonl").read_text().splitlines()]
    for j, answer in enumerate(answers):
        for r in records[j * N : (j + 1) * N]:
            assert r["answer"] == answer
            assert r["reward"] == (1.0 if extract_last_number(r["response"]) == answer else 0.0)
    assert any(r["reward"] == 1.0 for r in records)
    mean = sum(r["reward"] for r in records) / len(records)
    assert f"mean reward {mean:.3f}" in run.stdout


@pytest.mark.integration
def test_greedy_builtin_task_without_reward(runs: dict[str, Run]) -> None:
    run = runs["greedy"]
    assert run.rc == 0, run.stderr
    records = read_records(run.out)
    assert len(records) == 2 * 2
    for a, b in zip(records[::2], records[1::2], strict=True):
        assert a["prompt_id"] == b["prompt_id"] and (a["sample_index"], b["sample_index"]) == (0, 1)
        assert a["token_ids"] == b["token_ids"]  # greedy: the n samples agree
        assert a["answer"] is not None and a["reward"] is None and b["reward"] is None
    assert "mean reward n/a" in run.stdout


@pytest.mark.integration
def test_prompts_longer_than_the_step_budget_are_prefilled_in_chunks(runs: dict[str, Run]) -> None:
    # --max-num-batched-tokens 8 is far below the chat-templated prompt: the first steps compute
    # prompt chunks only. Greedy output must equal the unchunked run's.
    run = runs["greedy_chunked"]
    assert run.rc == 0, run.stderr[-2000:]
    chunked = [(r["prompt_id"], r["token_ids"]) for r in read_records(run.out)]
    assert chunked == [(r["prompt_id"], r["token_ids"]) for r in read_records(runs["greedy"].out)]


@pytest.mark.integration
@pytest.mark.parametrize("name", ["greedy_suffix", "greedy_eagle", "greedy_auto", "greedy_tree"])
def test_speculative_runs_emit_what_plain_greedy_emits(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.rc == 0, run.stderr[-2000:]
    records = read_records(run.out)
    assert [(r["token_ids"], r["logprobs"] and len(r["logprobs"])) for r in records] == [
        (r["token_ids"], r["logprobs"] and len(r["logprobs"])) for r in read_records(runs["greedy"].out)]
    assert re.search(r"\d+/\d+ drafts accepted, acceptance length \d\.\d\d", run.stdout), run.stdout
    assert re.search(r"\d+/[1-9]\d* drafts accepted", run.stdout), "nothing was drafted"


@pytest.mark.integration
def test_init_drafter_writes_a_loadable_drafter_and_refuses_bad_input(runs: dict[str, Run], work: Path,
                                                                     tmp_path: Path, capfd) -> None:
    from specroll.drafter.eagle_head import EagleHead

    head = EagleHead.load(work / "drafter_tiny")  # made by the `runs` fixture with --draft-vocab-size 300
    assert head.config.draft_vocab_size == 300 and head.config.target_vocab_size == 320
    assert head.config.feature_layers == (0, 1)  # a 2-layer model: (0, N/2, N-1) without repeats
    assert 2 in head.draft_to_target.tolist()  # the end-of-sequence token is always draftable
    out = tmp_path / "drafter"
    bad = _run([str(SPECROLL), "init-drafter", "--model", str(work / "no-such-model"), "--out", str(out)], out)
    assert bad.rc == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("specroll init-drafter: error: ") and "no-such-model" in bad.stderr
    assert not out.exists()
    for argv, words in ([["--out", ""], "--out is empty"],  # the entry point here: the process is proved above
                        [["--out", str(work / "gsm8k.jsonl" / "sub")], "cannot write the drafter"],
                        [["--out", str(out), "--draft-vocab-size", "321"], "exceeds the vocabulary"]):
        bad = _run_in_process(["init-drafter", "--model", str(work / "tiny"), *argv], out, capfd)
        assert bad.rc == 2 and bad.stderr.startswith("specroll init-drafter: error: "), bad.stderr
        assert words in bad.stderr and bad.stderr.count("\n") == 1 and bad.stdout == "", bad.stderr
        assert not out.exists()
