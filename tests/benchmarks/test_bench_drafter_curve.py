"""``benchmarks/bench_drafter_curve.py --quick``: the drafter-curve benchmark's smoke run on a tiny
random-weight checkpoint — rollouts generated then read back from the cache, every variant trained
to each of its checkpoints and measured offline (figures in range, the chain estimate built from
the per-position acceptance), the engine arms of the first variant measured, the JSON and the
figure written; two runs' results merged by ``--report``; bad arguments refused before anything loads."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bench_runs import run_benchmark
from helpers.timeouts import guard

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_drafter_curve.py"
QUESTIONS = ["Natalia sold clips to 48 of her friends in April. How many clips did she sell?",
             "Weng earns $12 an hour for babysitting. How much did she earn for 50 minutes?",
             "Betty needs $100 for a new wallet and has half of it. How much more does she need?",
             "James writes a 3-page letter to 2 friends twice a week. How many pages a year?"]


@pytest.mark.integration
def test_quick_run_measures_every_variant_and_reads_its_cache(tmp_path: Path, tiny_checkpoint) -> None:
    prompts = tmp_path / "gsm8k.jsonl"
    prompts.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in QUESTIONS * 4))
    model = tiny_checkpoint(max_position_embeddings=2048)
    out, figure = tmp_path / "curve.json", tmp_path / "curve.png"
    cmd = [sys.executable, str(BENCH), "--quick", "--model", str(model), "--train-prompts", str(prompts),
           "--test-prompts", str(prompts), "--cache-dir", str(tmp_path / "cache"), "--draft-vocab-size", "64",
           "--variants", "eagle3,eagle3-fullvocab", "--checkpoints", "0.01,0.02", "--max-minutes-other", "0.01",
           "--shapes", "2x2:3,2x2:3:sampled", "--json", str(out), "--plot", str(figure)]
    log, _ = run_benchmark(cmd, timeout_s=guard(600))
    assert "generated in" in log
    doc = json.loads(out.read_text())
    assert [v["variant"] for v in doc["variants"]] == ["eagle3", "eagle3-fullvocab"]
    main, full = doc["variants"]
    assert [p["checkpoint"] for p in main["points"]] == [0.01, 0.02]  # the main variant to the last one
    assert [p["checkpoint"] for p in full["points"]] == [0.01]  # the others to --max-minutes-other
    assert main["draft_vocab_size"] == 64 and full["draft_vocab_size"] == 320  # the tiny model's whole vocabulary
    for entry in doc["variants"]:
        for point in entry["points"]:
            assert point["cpu_minutes"] >= point["checkpoint"] and point["steps"] > 0
            o = point["offline"]
            pos = o["positions"]
            assert len(pos) == len(o["est_acceptance"]) == 4 and o["rows"] > 0 and o["target_entropy"] > 0
            assert all(0 <= x["accept_prob"] <= 1 and x["kl"] >= -1e-6 and 0 <= x["top1"] <= 1 for x in pos)
            # est_k − est_{k−1} = E[Π_{i≤k} (1 − TV_i)]: position 1's mean acceptance for k = 1, then
            # well below position k's own (a product of factors that are far from 1 for a head this young)
            est = o["est_acceptance"]
            steps = [est[0] - 1] + [b - a for a, b in itertools.pairwise(est)]
            assert steps[0] == pytest.approx(pos[0]["accept_prob"], rel=1e-6)
            assert all(0 <= s <= 0.9 * x["accept_prob"] for s, x in zip(steps[1:], pos[1:], strict=True))
            assert all(b <= a + 1e-9 for a, b in itertools.pairwise(steps))
    assert main["points"][0]["offline"]["positions"][0]["outside_mass"] > 0
    assert full["points"][0]["offline"]["positions"][0]["outside_mass"] < 1e-6
    engine = main["points"][-1]["engine"]
    assert main["points"][0]["engine"] is None and full["points"][-1]["engine"] is None  # --quick: the first only
    arms = ["off", "chain:1", "chain:2", "chain:3", "chain:4", "tree:2x2:3", "tree:2x2:3:sampled", "auto"]
    assert list(engine["batch1"]) == arms
    assert all(engine["batch1"][a]["acceptance_length"] >= 1 for a in arms[1:-1])  # auto may draft nothing
    assert len(engine["batch1"]["chain:4"]["accept_rate_per_pos"]) == 4
    assert set(engine["speed"]) == {"1", "2"} and engine["speed"]["2"]["off"]["ratio"] == 1.0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    other = tmp_path / "other.json"
    log, _ = run_benchmark([*cmd[:-4], "--variants", "eagle3-tv", "--engine-variants", "none", "--json", str(other)],
                           timeout_s=guard(300))
    assert "generated in" not in log and log.count("read from") == 2

    # --report: both runs' variants in one table, figure and file, each run's command kept
    merged, figure2 = tmp_path / "merged.json", tmp_path / "merged.png"
    log, _ = run_benchmark([sys.executable, str(BENCH), "--report", str(out), str(other), "--json", str(merged),
                            "--plot", str(figure2)], timeout_s=guard(120))
    doc2 = json.loads(merged.read_text())
    assert [v["variant"] for v in doc2["variants"]] == ["eagle3", "eagle3-fullvocab", "eagle3-tv"]
    assert [s["file"] for s in doc2["sources"]] == [str(out), str(other)]
    assert doc2["variants"][0] == main and "eagle3-tv" in log and figure2.read_bytes()[:4] == b"\x89PNG"
    proc = subprocess.run([sys.executable, str(BENCH), "--report", str(out), str(out)], capture_output=True,
                          text=True, timeout=guard(120))
    assert proc.returncode == 2 and "variant 'eagle3' is in both" in proc.stderr, proc.stderr


BAD_ARGUMENTS = [
    (["--variants", "eagle3,medusa"], "unknown or repeated ['medusa']"),
    (["--variants", "eagle3,eagle3"], "unknown or repeated"),
    (["--checkpoints", "5,2"], "'5,2': expected positive minutes in increasing order"),
    (["--checkpoints", "0,2"], "expected positive minutes"),
    (["--max-minutes-other", "1"], "--max-minutes-other 1.0: expected at least the first checkpoint"),
    (["--engine-at", "3"], "--engine-at [3.0]"),
    (["--variants", "eagle3", "--engine-variants", "eagle"], "--engine-variants eagle"),
    (["--shapes", "4x4"], "--shapes: tree shape '4x4'"), (["--batch-sizes", "4,16"], "expected 1 among them"),
    (["--json", "/nonexistent/x.json"], "/nonexistent does not exist"),
    (["--train-prompts", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["--report", "/nonexistent.json"], "--report /nonexistent.json: expected a results file"),
]


@pytest.mark.integration
def test_a_bad_argument_is_refused_by_the_script_with_exit_2() -> None:
    args, message = BAD_ARGUMENTS[0]
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("args", "message"), BAD_ARGUMENTS)
def test_bad_arguments_are_refused_before_anything_loads(args: list[str], message: str, capsys) -> None:
    """The script's argument checks (``parse_args``, the first thing its ``main`` does) in this process:
    the process above shows what the script does with their ``SystemExit``."""
    from bench_drafter_curve import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
