"""``specroll launch`` supervising its processes: a killed generator is restarted and the run ends
with exactly the groups it should have trained; past ``launch.max_restarts`` the run fails naming
the role; with ``max_restarts = 0`` any death ends the run. Real processes and sockets on a tiny
random model (the trainer's and the drafter trainer's restarts: ``test_bench_chaos.py``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from chaos_checks import check_run
from helpers.launch import (
    assert_nothing_left,
    children_of,
    finish,
    generators_connected,
    launch,
    started_pids,
    wait_for,
    welcomed,
    write_config,
)
from helpers.timeouts import guard


def supervised_config(tmp_path: Path, model: Path, steps: int, max_restarts: int) -> Path:
    config = write_config(tmp_path, model, steps=steps, count=2)
    config.write_text(config.read_text().replace("[trainer]\n", "[trainer]\ncheckpoint_every = 1\n")
                      + f"\n[launch]\nmax_restarts = {max_restarts}\nrestart_backoff_s = 0.2\n")
    return config


def metrics(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def reaped(run_dir: Path, pid: int) -> bool:
    """``pid`` is in pids.json's ``exited`` (with SIGKILL's code), not in its ``processes``, and no longer
    a zombie child of the launcher."""
    pids = json.loads((run_dir / "pids.json").read_text())
    if pid in pids["processes"].values() or {"role": "generator-0", "pid": pid, "exit_code": -9} not in pids["exited"]:
        return False
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return True  # gone
    return not (fields[0] == "Z" and int(fields[1]) == pids["launcher"])  # else: a new process took the pid


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_generator_is_restarted_and_the_run_trains_every_group_once(tmp_path: Path, tiny_checkpoint) -> None:
    config = supervised_config(tmp_path, tiny_checkpoint(), steps=30, max_restarts=3)
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    run_dir = tmp_path / "run"
    wait_for(lambda: generators_connected(run_dir, 2) and len(metrics(run_dir)) >= 2, "two steps", proc)
    # A tiny model trains a step in ~40 ms: with generator-0 running, the run could end inside the
    # restart's back-off. Paused, it holds the run until generator-1's restart has joined, so the
    # restart is always part of the run; its groups then resume on either generator.
    survivor, victim = started_pids(run_dir)["generator-0"], started_pids(run_dir)["generator-1"]
    os.killpg(survivor, signal.SIGSTOP)
    try:
        offset = (run_dir / "logs" / "generator-1.log").stat().st_size
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: welcomed(run_dir, "generator-1", offset), "generator-1 to rejoin", proc)
    finally:
        os.killpg(survivor, signal.SIGCONT)
    code, _, err = finish(proc, timeout=guard(300))
    assert code == 0, err
    assert f"generator-1 (pid {victim}) was killed by SIGKILL; restart 1 of generator-1 in 0.2 s" in err, err
    assert started_pids(run_dir)["generator-1"] != victim
    last = metrics(run_dir)[-1]
    assert (last["step"], last["restarts"], last["restarts_by_role"]) == (30, 1, {"generator-1": 1})
    checks = check_run(run_dir)
    assert checks.ok and not checks.lost and not checks.duplicated, checks
    # One group a batch; a skipped batch (its data too stale, on a loaded machine) is drawn again for its step.
    skipped = sum(1 for m in metrics(run_dir) if m.get("skipped"))
    assert checks.groups_trained == 30 + skipped and checks.max_staleness <= 1
    assert_nothing_left(run_dir, before)


@pytest.mark.integration
@pytest.mark.slow
def test_a_generator_dying_past_max_restarts_ends_the_run_naming_it(tmp_path: Path, tiny_checkpoint) -> None:
    config = supervised_config(tmp_path, tiny_checkpoint(), steps=1_000_000, max_restarts=1)
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    run_dir = tmp_path / "run"
    wait_for(lambda: generators_connected(run_dir, 2), "both generators to connect", proc)
    first = started_pids(run_dir)["generator-0"]
    offset = (run_dir / "logs" / "generator-0.log").stat().st_size
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: welcomed(run_dir, "generator-0", offset), "generator-0 to rejoin", proc)
    # the dead process is reaped while the run goes on (no zombie until the end), and pids.json says so
    wait_for(lambda: reaped(run_dir, first), f"the launcher to reap generator-0's first process {first}", proc)
    second = started_pids(run_dir)["generator-0"]
    assert second != first and second in json.loads((run_dir / "pids.json").read_text())["processes"].values()
    os.kill(second, signal.SIGKILL)
    code, _, err = finish(proc, timeout=guard(120))
    assert code == 1, err
    assert "restart 1 of generator-0" in err, err
    assert (f"generator-0 (pid {second}) was killed by SIGKILL (2 deaths within 600 s, more than "
            "launch.max_restarts = 1); stopping the run" in err), err
    assert "logs/generator-0.log" in err
    assert_nothing_left(run_dir, before)


def test_the_steps_a_restarted_trainer_runs_again_are_printed_again(tmp_path: Path) -> None:
    """The restarted trainer rewrites metrics.jsonl back to its checkpoint (a new file) and appends the
    re-run steps: the launcher prints those, marked as re-runs, and never a line it printed already."""
    import io

    from specroll.actors.config import RunConfig
    from specroll.actors.launch.launch import Launcher
    from specroll.actors.shared.files import write_text_atomic

    def lines(*records: tuple[int, float]) -> str:
        return "".join(json.dumps({"step": s, "loss": loss}) + "\n" for s, loss in records)

    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    launcher = Launcher(RunConfig(run_dir=str(tmp_path)), out=io.StringIO(), metrics_out=out)
    path.write_text(lines((1, 0.5)))
    launcher.metrics_tail.skip_existing()  # an earlier launch's line, as run() takes it
    with path.open("a") as f:
        f.write(lines((2, 0.4), (3, 0.3)))
    launcher._print_metrics()
    write_text_atomic(path, lines((1, 0.5), (2, 0.4)) + lines((3, 0.25), (4, 0.2)))  # resumed from step 2
    launcher._print_metrics()
    # resumed from step 3 again, its weights evaluated again: step 3's line written again with the figure
    write_text_atomic(path, lines((1, 0.5), (2, 0.4)) + json.dumps({"step": 3, "loss": 0.25, "eval_accuracy": 0.5})
                      + "\n" + lines((4, 0.21)))
    launcher._print_metrics()
    assert out.getvalue().splitlines() == [
        "step 2: loss=0.4", "step 3: loss=0.3", "step 3 (re-run): loss=0.25", "step 4: loss=0.2",
        "step 3 (evaluated again): eval_accuracy=0.5 loss=0.25", "step 4 (re-run): loss=0.21"]


def test_a_pids_file_that_cannot_be_written_is_one_warning_not_the_launchers_end(tmp_path: Path) -> None:
    """A full disk (here: a run directory below a file) makes pids.json unwritable: supervision goes on
    with one warning line, said again only after a write succeeded in between."""
    from specroll.actors.launch.role_starts import RoleStarts

    (tmp_path / "file").write_text("")
    said: list[str] = []
    starts = RoleStarts(tmp_path / "file" / "run", said.append, lambda: None)
    starts.write_pids()
    starts.write_pids(launcher_running=False)
    assert len(said) == 1 and said[0].startswith("warning: cannot write ") and "pids.json" in said[0], said
    starts.run_dir = tmp_path
    starts.write_pids()
    assert json.loads((tmp_path / "pids.json").read_text())["processes"] == {}
