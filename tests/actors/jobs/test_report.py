"""``specroll report``: figures from a synthetic run directory (bad lines included), the errors of a
run directory that is not one, and a real tiny launch reported on, whole and with its last metrics
line cut short."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.timeouts import guard

from specroll.actors.jobs.report import FIGURES, draw_acceptance, draw_timeline, run_report
from specroll.actors.jobs.report_data import acceptance_by_drafter, load_run, samples_per_s

PNG = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0


def metrics_line(step: int) -> dict[str, object]:
    return {
        "step": step,
        "time": T0 + 10.0 * step,
        "reward_mean": 0.1 * step,
        "accuracy": 0.05 * step,
        "eval_accuracy": 0.5 if step % 3 == 0 else None,  # only some steps evaluate
        "eval_step": step - 1 if step % 3 == 0 else None,  # the weights of the step before
        "samples": 8,
        "step_s": 4.0,
        "wait_s": 1.0,
        "gen_tokens_per_s": 100.0 + step,
        "staleness": {"0": 50, "1": 10 * step},
        "max_lag": 1,
        "acceptance_by_version": [
            {"drafter_version": 1, "policy_version": step, "acceptance_length": 1.5, "draft_steps": 10},
            {"drafter_version": 2, "policy_version": step, "acceptance_length": 2.0 + step % 2,
             "draft_steps": 10 * step},
        ] if step >= 2 else [],
    }


def timeline_events() -> list[dict[str, object]]:
    events: list[dict[str, object]] = []
    for i in range(20):
        for actor in ("generator-0", "generator-1"):
            events.append({"t": T0 + i, "event": "generator_load", "actor": actor, "live": i % 5, "capacity": 8})
    for step in range(1, 4):
        start = T0 + 5 * step
        events += [
            {"t": start + 1, "event": "phase", "phase": "wait", "start": start, "end": start + 1, "step": step},
            {"t": start + 3, "event": "phase", "phase": "train", "start": start + 1, "end": start + 3, "step": step},
            {"t": start + 3, "event": "group_finished", "group_id": f"g{step}", "lane": "train"},
            {"t": start + 3, "event": "step_groups", "step": step, "group_ids": [f"g{step}"]},
            {"t": start + 4, "event": "phase", "phase": "publish", "start": start + 3, "end": start + 4, "step": step},
            {"t": start + 4, "event": "policy_published", "version": step},
            {"t": start + 4.5, "event": "policy_served", "actor": "generator-0", "version": step},
        ]
    events += [
        {"t": T0 + 17, "event": "phase", "phase": "eval_wait", "start": T0 + 16, "end": T0 + 17, "step": 3},
        {"t": T0 + 17, "event": "evaluation", "step": 3, "policy_version": 3, "accuracy": 0.5, "prompts": 4},
        {"t": T0 + 8, "event": "drafter_published", "version": 1},
        {"t": T0 + 9, "event": "drafter_served", "actor": "generator-1", "version": 1},
    ]
    return events


def write_run(run_dir: Path) -> None:
    """Steps 1-8 with line 4 malformed and a 9th line cut short; a timeline whose line 3 has a bad field."""
    run_dir.mkdir()
    lines = [json.dumps(metrics_line(s)) for s in range(1, 9)]
    lines[3] = '{"step": 4, "reward_mean": 0.4,, }'
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 9, "reward_me')
    events = [json.dumps(e) for e in timeline_events()]
    events[2] = json.dumps({"t": T0, "event": "generator_load", "actor": "generator-0", "live": "many"})
    (run_dir / "timeline.jsonl").write_text("\n".join(events) + "\n")


def report(run_dir: Path, *extra: str) -> tuple[int, list[str], list[str]]:
    out, err = io.StringIO(), io.StringIO()
    code = run_report(str(run_dir), *extra, stdout=out, stderr=err)
    return code, out.getvalue().splitlines(), err.getvalue().splitlines()


def assert_pngs(paths: list[str], folder: Path) -> None:
    assert paths == [str(folder / name) for name in FIGURES]
    assert list(FIGURES) == ["reward.png", "throughput.png", "staleness.png", "acceptance.png", "timeline.png"]
    for path in paths:
        data = Path(path).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG), path


def test_every_figure_is_drawn_and_each_bad_line_is_one_warning(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir)
    code, out, err = report(run_dir)
    assert code == 0, err
    assert_pngs(out, run_dir / "report")
    metrics, timeline = run_dir / "metrics.jsonl", run_dir / "timeline.jsonl"
    assert len(err) == 3, err
    assert err[0].startswith(f"specroll report: warning: {metrics}: line 4: not JSON")
    assert err[1] == f"specroll report: warning: {metrics}: line 9: cut short (no newline at the end: the run " \
                     "was killed mid-write?); skipped"
    assert err[2] == f"specroll report: warning: {timeline}: line 3: live='many' (expected an integer); not drawn"


def test_what_is_drawn(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir)
    data = load_run(run_dir)
    assert [r.step for r in data.steps] == [1, 2, 3, 5, 6, 7, 8]
    assert [r.eval_accuracy for r in data.steps] == [None, None, 0.5, None, 0.5, None, None]
    assert [r.eval_step for r in data.steps] == [None, None, 2, None, 5, None, None]
    # 8 samples per 10 s between consecutive steps; after the gap, step_s + wait_s = 5 s
    assert samples_per_s(data) == [(1, 8 / 5), (2, 0.8), (3, 0.8), (5, 8 / 5), (6, 0.8), (7, 0.8), (8, 0.8)]
    # weighted by verify steps: version 2 has 2 (even steps) or 3 (odd) over 10·step verify steps each
    steps_v2 = [2, 3, 5, 6, 7, 8]
    mean_v2 = sum((2.0 + s % 2) * 10 * s for s in steps_v2) / sum(10 * s for s in steps_v2)
    assert acceptance_by_drafter(data.steps) == {1: (1.5, 60), 2: (pytest.approx(mean_v2), 310)}
    assert mean_v2 != pytest.approx(sum(2.0 + s % 2 for s in steps_v2) / 6)  # unweighted would differ
    assert acceptance_by_drafter(data.steps[1:2]) == {1: (1.5, 10), 2: (2.0, 20)}
    assert len(data.loads) == 39 and {p.phase for p in data.phases} == {"wait", "train", "publish", "eval_wait"}
    assert [a.kind for a in data.arrivals].count("policy_served") == 3 and data.step_groups == {1: 1, 2: 1, 3: 1}
    timeline = draw_timeline(data)
    assert [ax.get_ylabel() for ax in timeline.axes] == ["generator-0\nlive seqs", "generator-1\nlive seqs", "trainer"]


def test_samples_fall_back_to_the_groups_times_the_group_size(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir)
    lines = [json.dumps({**metrics_line(s), "samples": None, "time": None, "samples_dropped_stale": s - 1})
             for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert samples_per_s(load_run(run_dir)) == []  # no samples, no config: nothing to draw
    (run_dir / "config.toml").write_text("[trainer]\ngroup_size = 4\nbatch_groups = 3\n")
    data = load_run(run_dir)
    assert data.step_groups == {1: 1, 2: 1, 3: 1}  # from the timeline's step_groups events
    data.step_groups = {2: 2}  # step 2's event wins over batch_groups; step 1 has none
    assert samples_per_s(data) == [(1, 12 / 5), (2, (8 - 1) / 5)]


def test_no_speculation_and_no_timeline_still_draw_with_a_note(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [json.dumps({**metrics_line(s), "acceptance_by_version": []}) for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = report(run_dir, str(tmp_path / "elsewhere"))
    assert code == 0, err
    assert_pngs(out, tmp_path / "elsewhere")
    assert err == [f"specroll report: warning: {run_dir / 'timeline.jsonl'}: missing"]
    data = load_run(run_dir)
    texts = [t.get_text() for fig in (draw_acceptance(data), draw_timeline(data)) for ax in fig.axes for t in ax.texts]
    assert any("no speculation in this run" in t for t in texts), texts
    assert "no timeline.jsonl in this run" in texts


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specroll.actors.cli", "report", *args], capture_output=True,
                          text=True, timeout=guard(120))


@pytest.mark.integration
def test_not_a_run_directory_is_one_error_line_and_exit_2(tmp_path: Path) -> None:
    proc = cli(str(tmp_path / "nope"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("specroll report: error: run directory"), proc.stderr
    assert "does not exist" in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = cli(str(tmp_path / "empty"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "metrics.jsonl is missing" in proc.stderr
    (tmp_path / "empty" / "metrics.jsonl").write_text("[1]\n")
    proc = cli(str(tmp_path / "empty"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 2, proc.stderr  # the bad line, then the error
    assert "line 1: a JSON list" in proc.stderr and "holds no step record" in proc.stderr
    assert not (tmp_path / "empty" / "report").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_a_real_launch_is_reported_whole_and_cut_short(tmp_path: Path, tiny_checkpoint) -> None:
    from helpers.launch import finish, launch, write_config

    config = write_config(tmp_path, tiny_checkpoint(), steps=3, count=2, eval_every=2)
    code, _, err = finish(launch(tmp_path, config))
    run_dir = tmp_path / "run"
    assert code == 0, err
    assert f"specroll launch: report: specroll report {run_dir}" in err.splitlines()
    proc = cli(str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert_pngs(proc.stdout.splitlines(), run_dir / "report")
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text()
    last_line = text.rstrip("\n").count("\n") + 1  # the records a run writes vary (warnings, evaluations)
    metrics.write_text(text[: text.rstrip("\n").rfind("\n") + 1] + text.rstrip("\n").rsplit("\n", 1)[1][:20])
    for png in (run_dir / "report").iterdir():
        png.unlink()
    proc = cli(str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert_pngs(proc.stdout.splitlines(), run_dir / "report")
    assert f"{metrics}: line {last_line}: cut short" in proc.stderr, proc.stderr


def test_a_skipped_batch_is_not_drawn_as_its_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir)
    records = [metrics_line(1), {**metrics_line(2), "skipped": True, "reward_mean": 123.0}, metrics_line(2),
               {**metrics_line(3), "skipped": True, "reward_mean": 456.0}]  # killed right after a skipped batch
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = load_run(run_dir)
    assert [s.step for s in data.steps] == [1, 2]  # the skipped lines are not steps
    assert all(s.reward_mean not in (123.0, 456.0) for s in data.steps)
