"""``specroll launch``: real processes (launcher, trainer, generators on a tiny random model), real
sockets; every test checks that no process the launcher started outlives it.

The trainer is the real one (``specroll.actors.trainer``); the launcher's hidden
``--trainer-module`` option is used only to start a trainer that cannot start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launch import (
    assert_nothing_left,
    children_of,
    finish,
    generators_connected,
    launch,
    model_loaded,
    started_pids,
    wait_for,
    with_drafter,
    write_config,
)
from helpers.timeouts import guard


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("fork_roles", [True, False], ids=["forked", "fresh-interpreters"])
def test_launch_runs_three_steps_and_leaves_nothing(tmp_path: Path, tiny_checkpoint, fork_roles: bool) -> None:
    config = write_config(tmp_path, tiny_checkpoint(), steps=3, count=2, eval_every=2)
    config.write_text(config.read_text() + f"\n[launch]\nfork_roles = {str(fork_roles).lower()}\n")
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    run_dir = tmp_path / "run"
    if not fork_roles:
        # A fresh interpreter spends seconds importing torch before it handles SIGTERM itself, and the
        # trainer needs one generator to finish this short run: the launcher's SIGTERM could end the
        # other mid-import. The trainer is held (its endpoint written, before any generator can join)
        # until both generators handle a stop, so neither can die of it.
        wait_for(lambda: (run_dir / "trainer.endpoint").exists(), "the trainer's endpoint", proc)
        trainer = started_pids(run_dir)["trainer"]
        os.killpg(trainer, signal.SIGSTOP)
        try:
            wait_for(lambda: all(model_loaded(run_dir, f"generator-{i}") for i in range(2)), "both models", proc)
        finally:
            os.killpg(trainer, signal.SIGCONT)
    code, out, err = finish(proc)
    assert code == 0, err
    assert set(started_pids(run_dir)) == {"trainer", "generator-0", "generator-1"}
    assert_nothing_left(run_dir, before)
    # A batch whose every token came out too stale is skipped and drawn again (a line marked
    # "skipped", not a step): on a loaded machine generation can run that far ahead.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("skipped") is not True]
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: the evaluation before training
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2, 3]
    assert all(r["eval_step"] == r["step"] for r in records if "eval_accuracy" in r)
    lines = [line.split(":")[0] for line in out.splitlines() if " skipped (" not in line.split(":")[0]]
    assert lines == ["step 0", "step 1", "step 2", "step 3"]
    assert "eval_accuracy=" in out.splitlines()[0]
    assert (run_dir / "config.toml").exists() and (run_dir / "trainer.endpoint").exists()
    logs = [(run_dir / "logs" / f"generator-{i}.log").read_text() for i in range(2)]
    # Each is stopped by the launcher's SIGTERM (not by the SIGKILL fallback) — also a forked one still
    # loading its model when the short run ended, which a loaded machine makes possible; one served.
    assert all("exits with code 0: received SIGTERM" in log for log in logs), logs
    assert any("welcomed by" in log for log in logs), logs
    assert all(log.startswith(f"==== specroll launch: generator-{i} {'forked' if fork_roles else 'started'} ")
               for i, log in enumerate(logs)), logs
    assert "finished 3 steps" in err


@pytest.mark.integration
def test_config_error_exits_2_and_starts_nothing(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n[trainer]\ngroup_sise = 4\n')
    before = children_of(os.getpid())
    code, out, err = finish(launch(tmp_path, config))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "trainer.group_sise" in err and "group_size" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()
    # an override out of range: the same
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n')
    code, _, err = finish(launch(tmp_path, config, "--set", "trainer.group_size=1"))
    assert code == 2 and err.count("\n") == 1 and "group_size=1" in err, err
    assert not (tmp_path / "run").exists()
    assert children_of(os.getpid()) <= before


@pytest.mark.integration
def test_trainer_dying_before_its_endpoint_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n')
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer.endpoint").write_text("tcp://127.0.0.1:1")  # stale: must not be used
    env_module = "no_such_trainer_module_xyz"
    cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(config), "--trainer-module", env_module]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 1, proc.stderr
    assert "trainer (pid" in proc.stderr and "exited with code 1 before writing its endpoint" in proc.stderr
    assert "No module named" in proc.stderr  # the tail of its log
    assert set(started_pids(tmp_path / "run")) == {"trainer"}  # no generator was started
    assert_nothing_left(tmp_path / "run", set())


@pytest.mark.integration
def test_config_warnings_are_printed_at_start(tmp_path: Path, tiny_checkpoint) -> None:
    """A drafter trainer no generator drafts with: one warning line before anything starts."""
    config = write_config(tmp_path, tiny_checkpoint())
    cmd = [sys.executable, "-m", "specroll.actors.cli", "launch", str(config), "--set", "drafter.enabled=true",
           "--set", "drafter.draft_vocab_size=64", "--trainer-module", "no_such_trainer_module_xyz"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 1, proc.stderr  # the stand-in trainer cannot start
    warning, started = proc.stderr.index("specroll launch: warning: drafter.enabled = true with "
                                         "generator.speculative = 'off'"), proc.stderr.index("started trainer")
    assert warning < started, proc.stderr
    assert_nothing_left(tmp_path / "run", set())


def test_a_warning_in_a_metrics_record_is_printed_by_the_launcher(tmp_path: Path) -> None:
    """The trainer's acceptance-floor and skipped-checkpoint warnings reach the launcher's output, not only
    trainer.log."""
    import io

    from specroll.actors.config import RunConfig
    from specroll.actors.launch.launch import Launcher

    out, metrics_out = io.StringIO(), io.StringIO()
    launcher = Launcher(RunConfig(run_dir=str(tmp_path)), out=out, metrics_out=metrics_out)
    text = "acceptance length 1.20 under policy version 3 is below the floor 2.00 (drafter version 1, ...)"
    full = "checkpoint of step 4 not written (model.safetensors: No space left on device); training goes on, ..."
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 0.5, "acceptance_floor_warning": text})
                                            + "\n" + json.dumps({"step": 4, "loss": 0.4,
                                                                  "acceptance_floor_warning": None}) + "\n"
                                            + json.dumps({"step": 5, "loss": 0.3, "checkpoint_warning": full}) + "\n")
    launcher._print_metrics()
    assert metrics_out.getvalue() == "step 3: loss=0.5\nstep 4: loss=0.4\nstep 5: loss=0.3\n"
    assert out.getvalue() == f"specroll launch: warning: step 3: {text}\nspecroll launch: warning: step 5: {full}\n"


@pytest.mark.integration
@pytest.mark.slow
def test_sigkilled_generator_tears_down_the_run_without_supervision(tmp_path: Path, tiny_checkpoint) -> None:
    """``launch.max_restarts = 0``: the first death ends the run (supervision: ``test_supervision.py``)."""
    config = write_config(tmp_path, tiny_checkpoint(), steps=1_000_000, count=2)
    config.write_text(config.read_text() + "\n[launch]\nmax_restarts = 0\n")
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    run_dir = tmp_path / "run"
    wait_for(lambda: generators_connected(run_dir, 2), "both generators to connect", proc)
    victim = started_pids(run_dir)["generator-1"]
    os.kill(victim, signal.SIGKILL)
    code, _, err = finish(proc)
    assert code == 1, err
    assert f"generator-1 (pid {victim}) was killed by SIGKILL" in err, err
    assert "logs/generator-1.log" in err
    assert "exits with code 0: received SIGTERM" in (run_dir / "logs" / "generator-0.log").read_text()
    assert_nothing_left(run_dir, before)


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_tears_down_the_run(tmp_path: Path, tiny_checkpoint) -> None:
    config = write_config(tmp_path, tiny_checkpoint(), steps=1_000_000, count=1)
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    run_dir = tmp_path / "run"
    wait_for(lambda: generators_connected(run_dir, 1), "the generator to connect", proc)
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc)
    assert code == 130, err
    assert "interrupted by SIGINT" in err
    assert "SIGKILL" not in err.split("interrupted by SIGINT")[1]  # everyone stopped within the grace period
    assert "exits with code 0: received SIGTERM" in (run_dir / "logs" / "generator-0.log").read_text()
    assert_nothing_left(run_dir, before)


STAND_IN_TRAINER = """
import json, pathlib, signal, sys, time, tomllib
run_dir = pathlib.Path(tomllib.loads(pathlib.Path(sys.argv[sys.argv.index("--config") + 1]).read_text())["run_dir"])

def stop(signum, frame):  # the trainer's last line, written while the launcher tears the run down
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 7, "loss": 0.125}) + "\\n")
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, stop)
(run_dir / "trainer.endpoint").write_text("tcp://127.0.0.1:9")
while True:
    time.sleep(0.05)
"""


@pytest.mark.integration
def test_the_metrics_a_trainer_writes_while_the_run_stops_are_printed(tmp_path: Path, tiny_checkpoint) -> None:
    """A stand-in trainer writes a metrics line only when SIGTERMed: the launcher's teardown after a
    Ctrl-C prints it (the last look at the file comes after every process stopped)."""
    (tmp_path / "stand_in_trainer.py").write_text(STAND_IN_TRAINER)
    config = write_config(tmp_path, tiny_checkpoint(), steps=1_000_000, count=1)
    before = children_of(os.getpid())
    proc = launch(tmp_path, config, "--trainer-module", "stand_in_trainer", path=tmp_path)
    run_dir = tmp_path / "run"
    wait_for(lambda: (run_dir / "pids.json").exists() and "generator-0" in started_pids(run_dir),
             "the generator to start", proc)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 130, err
    assert "step 7: loss=0.125" in out.splitlines(), (out, err)
    assert json.loads((run_dir / "pids.json").read_text())["launcher"] is None  # the launch is over
    assert_nothing_left(run_dir, before)


def test_generator_settings_from_config_with_flag_overrides(tmp_path: Path) -> None:
    from specroll.actors.generator.cli import parse_args

    config = tmp_path / "run.toml"
    config.write_text('[model]\nname = "some/model"\n[generator]\nstream_every_steps = 3\nkv_policy = "recompute"\n'
                      '[generator.engine]\nmax_num_seqs = 5\nnum_threads = 1\nkv_cache_memory_gb = 0.25\n'
                      '[network]\nwindow = 32\nheartbeat_timeout_s = 9.0\n')
    s = parse_args(["--config", str(config), "--connect", "tcp://127.0.0.1:9", "--actor-id", "g1",
                    "--set", "generator.speculative=auto", "--max-num-seqs", "7"])
    c = s.config
    assert (c.generator.engine.model, s.actor_id, c.generator.stream_every_steps, c.generator.kv_policy,
            c.generator.engine.num_threads, c.generator.engine.kv_cache_memory_gb) == (
        "some/model", "g1", 3, "recompute", 1, 0.25)
    assert (c.network.window, c.network.heartbeat_timeout_s, c.speculative()) == (32, 9.0, "suffix")  # auto, no drafter
    assert c.generator.engine.max_num_seqs == 7  # the explicit flag wins over generator.engine.max_num_seqs
    flags_only = parse_args(["--connect", "tcp://127.0.0.1:9", "--model", "m", "--max-num-seqs", "2"]).config
    assert (flags_only.generator.engine.model, flags_only.generator.engine.max_num_seqs,
            flags_only.generator.engine.kv_cache_memory_gb) == ("m", 2, 1.0)


@pytest.mark.integration
def test_generator_config_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[generator]\nkv_policy = \"sometimes\"\n")
    for args in (["--config", str(config)], ["--set", "a=1", "--model", "m"], ["--model", str(tmp_path / "none")]):
        proc = subprocess.run([sys.executable, "-m", "specroll.actors.generator", "--connect", "tcp://127.0.0.1:9",
                               *args], capture_output=True, text=True, timeout=guard(60))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "generator.kv_policy='sometimes'" in subprocess.run(
        [sys.executable, "-m", "specroll.actors.cli", "generator", "--config", str(config), "--connect",
         "tcp://127.0.0.1:9"], capture_output=True, text=True, timeout=guard(60)).stderr


def refused(tmp_path: Path, config: Path, extra: list[str], capsys: pytest.CaptureFixture[str],
            in_process: bool) -> tuple[int, str]:
    """``specroll launch CONFIG EXTRA...`` refused before anything starts: (exit code, stderr). A real
    ``specroll launch`` process, or (``in_process``, the same code without an interpreter's start) its
    entry called here, roles not forked (nothing is started either way)."""
    from specroll.actors.launch.entry import run_launch

    if not in_process:
        code, out, err = finish(launch(tmp_path, config, *extra))
        assert out == "", out
        return code, err
    capsys.readouterr()
    code = run_launch(str(config), [*extra[1::2], "launch.fork_roles=false"])
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    return code, captured.err


@pytest.mark.integration
def test_missing_inputs_and_a_taken_port_exit_2_before_anything_starts(tmp_path: Path, tiny_checkpoint,
                                                                       capsys) -> None:
    import socket

    model = tiny_checkpoint()
    config = write_config(tmp_path, model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        unanswered = tmp_path / "unanswered.jsonl"
        unanswered.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "Why?"}\n')
        cases = [
            (["--set", f'task.prompts="{tmp_path / "nope.jsonl"}"'], "task.prompts"),
            (["--set", f'eval.prompts="{tmp_path / "nope.jsonl"}"'], "eval.prompts: "),
            (["--set", f'eval.prompts="{unanswered}"'], "eval.prompts: evaluation prompts without an answer"),
            (["--set", "eval.count=300"], "eval.count: 1-digit problems"),  # 255 one-digit problems
            (["--set", 'task.operators="-"', "--set", "eval.count=55"], "with '-' number 55"),
            (["--set", f'model.name="{tmp_path / "no-model"}"'], "model.name"),
            (["--set", f"network.trainer_port={port}"], f"network.trainer_port={port}"),
            (["--set", "trainer.group_size=65"],
             "trainer.group_size=65, expected at most generator.engine.max_num_seqs"),
        ]
        for i, (extra, key) in enumerate(cases):
            code, err = refused(tmp_path, config, extra, capsys, in_process=i > 0)
            assert code == 2 and key in err and err.count("\n") == 1, err
            assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_resume_replaces_the_metrics_of_steps_after_the_checkpoint(tmp_path: Path) -> None:
    from specroll.actors.trainer.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3, 4)) + '{"step": 5, "cut')  # killed mid-line
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


@pytest.mark.integration
@pytest.mark.slow
def test_drafter_trainer_publishes_and_its_death_stops_nothing(tmp_path: Path, tiny_checkpoint) -> None:
    """The drafter trainer is SIGKILLed: the launcher restarts it (it warm-starts from RUN_DIR/drafter,
    ``test_drafter_actor.py``) and training goes on to the end meanwhile."""
    config = with_drafter(write_config(tmp_path, tiny_checkpoint(), steps=40, count=1))
    before = children_of(os.getpid())
    proc = launch(tmp_path, config)
    run_dir = tmp_path / "run"
    drafter_log = run_dir / "logs" / "drafter.log"
    served = run_dir / "logs" / "generator-0.log"
    wait_for(lambda: served.exists() and "serving drafter version 1" in served.read_text(errors="replace"),
             "the generator to serve drafter version 1", proc)
    victim = started_pids(run_dir)["drafter"]
    os.kill(victim, signal.SIGKILL)
    code, _, err = finish(proc, timeout=guard(300))
    assert code == 0, err
    assert f"drafter (pid {victim}) was killed by SIGKILL; restart 1 of drafter" in err, err
    assert "sent drafter version 1 to the trainer" in drafter_log.read_text()
    records = [r for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if not (r := json.loads(line))["skipped"]]
    assert [r["step"] for r in records] == list(range(1, 41))  # training went on to the end
    assert any(p["drafter_version"] >= 1 and p["draft_steps"] > 0 for r in records for p in r["acceptance_by_version"])
    assert records[-1]["generator_drafters"]["generator-0"] >= 1 and records[-1]["drafter_checksums_match"]
    assert (run_dir / "drafter" / "model.safetensors").exists()  # the latest version, for a warm start
    assert_nothing_left(run_dir, before)


@pytest.mark.integration
def test_a_bad_drafter_exits_2_before_anything_starts(tmp_path: Path, tiny_checkpoint, capsys) -> None:
    import torch

    from specroll.actors.config import load_config
    from specroll.actors.launch.preflight import preflight
    from specroll.drafter.eagle_config import EagleConfig
    from specroll.drafter.eagle_head import EagleHead
    from specroll.engine.loaders.checkpoint import load_checkpoint

    model = tiny_checkpoint()
    config = write_config(tmp_path, model)
    fits = EagleConfig.for_target(load_checkpoint(str(model)).config, (2,), 64)
    EagleHead.init(fits, torch.arange(64)).save(good := tmp_path / "good")
    (junk_file := tmp_path / "junk.bin").write_bytes(b"\x00junk")
    (junk_config := tmp_path / "junk_config").mkdir()
    (junk_config / "config.json").write_text('{"x": 1}')
    (junk_config / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    EagleHead.init(fits, torch.arange(64)).save(cut := tmp_path / "cut")
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:100])  # checksums.json kept
    EagleHead.init(fits, torch.arange(64)).save(junk_weights := tmp_path / "junk_weights")
    (junk_weights / "model.safetensors").write_bytes(b"\x00" * 100)
    (junk_weights / "checksums.json").unlink()  # a folder made by hand (or another tool): no checksums to check
    other = EagleConfig(400, 64, 128, 4, 2, 16, 1e-5, 10000.0, (2,), 100, 2)  # a 400-token vocabulary
    EagleHead.init(other, torch.arange(100)).save(foreign := tmp_path / "foreign")
    cases = [
        ([f'drafter.path="{tmp_path / "no-drafter"}"'], "drafter.path", "does not exist"),
        ([f'drafter.path="{junk_file}"'], "drafter.path", "not a directory"),
        ([f'drafter.path="{junk_config}"'], "drafter.path", "expected a drafter config as 'specroll init-drafter'"),
        ([f'drafter.path="{junk_weights}"'], "drafter.path", "not a readable safetensors file"),
        ([f'drafter.path="{cut}"'], "drafter.path", "model.safetensors: 100 bytes, checksums.json says"),
        ([f'drafter.path="{foreign}"'], "drafter.path", "vocabulary 400"),
        (["drafter.enabled=true", "drafter.draft_vocab_size=321"], "drafter.draft_vocab_size=321",
         "(320 tokens)"),
    ]
    before = children_of(os.getpid())
    for i, (sets, key, words) in enumerate(cases):
        code, err = refused(tmp_path, config, [x for s in sets for x in ("--set", s)], capsys, in_process=i > 0)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"specroll launch: error: {key}") and words in err, err
        assert "Traceback" not in err and not (tmp_path / "run").exists()
    assert children_of(os.getpid()) <= before
    # what fits passes: a drafter made for this model, a draft vocabulary as large as the model's
    assert preflight(load_config(config, [f'drafter.path="{good}"'])) is None
    assert preflight(load_config(config, ["drafter.enabled=true", "drafter.draft_vocab_size=320"])) is None
