"""The trainer's W&B and TensorBoard sinks (``actors/telemetry/sinks.py``): flattening a record, a real
offline W&B run read back from its ``.wandb`` file, real TensorBoard event files read back, the error
when a package is missing, and a failing sink switched off.

W&B runs offline with its endpoints pointed at a closed local port and its home directories in a
temporary one: nothing reaches the network or the user's ``~/.config/wandb``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.sink_files import WandbRun, event_files, read_wandb_run, scalars

from specroll.actors.config import NetworkConfig, RunConfig
from specroll.actors.config.metrics_section import MetricsConfig
from specroll.actors.config.server_section import ServerConfig
from specroll.actors.telemetry.sinks import (
    MAX_SCALARS,
    WANDB_ID_FILENAME,
    MetricsSinkUnavailable,
    RecordSinks,
    flatten_record,
    public_config,
    wandb_run_id,
)

SERVER_KEY, METRICS_KEY, KEYS_DIR = "srv-4f1e-secret", "mtr-9b2c-secret", "/keys-7d3a-secret"
SKIPPED_LOSS = -7.25  # only the skipped batch's record has it
BEHIND_LOSS = -3.5  # only a record of a step W&B already has


def _record(step: int, **changes: object) -> dict[str, object]:
    """A ``metrics.jsonl`` record with the keys ``StepMetrics.record`` and ``append_metrics`` write."""
    record: dict[str, object] = {
        "step": step, "time": 1.7e9 + step, "samples": 16, "policy_version": step, "trained_version": step - 1,
        "reward_mean": 0.25 * step, "accuracy": 0.5, "loss": 0.125 * step, "is_weight_mean": 1.0,
        "truncated_fraction": 0.0, "clip_fraction": 0.03, "approx_kl": 0.001, "grad_norm": 2.5,
        "trained_tokens": 812, "skipped": False, "tokens_masked_stale": 0, "samples_dropped_stale": 0,
        "staleness": {"0": 700, "1": 112}, "max_lag": 1, "logprob_diff_mean": 0.002, "logprob_diff_max": 0.09,
        "logprob_kl_k3": 1e-5, "logprob_mismatch_tokens": 700, "response_tokens_mean": 50.75,
        "gen_tokens_per_s": 1234.5, "acceptance_length": None, "acceptance_length_window": None,
        "acceptance_by_version": [], "acceptance_below_floor": False, "acceptance_floor_warning": None,
        "drafter_version": None, "drafter_policy_version": None, "generator_drafters": {},
        "drafter_checksums_match": True, "drafter_trainers": 0, "generators_alive": 2, "generators_dead": 0,
        "generator_versions": {"generator-0": step, "generator-1": step - 1}, "groups_resumed": 0,
        "step_s": 3.5, "wait_s": 0.5, "train_s": 2.75, "threads_borrowed": None,
        "restarts": 1, "restarts_by_role": {"generator": 1},
    }
    record.update(changes)
    return record


def test_flatten_record_keeps_the_numbers_under_the_metrics_jsonl_keys() -> None:
    record = _record(3, eval_accuracy=0.75, eval_versions=[3], eval_s=float("nan"), grad_norm=float("inf"))
    flat = flatten_record(record)
    assert flat["step"] == 3 and isinstance(flat["step"], int)
    assert flat["loss"] == 0.375 and flat["eval_accuracy"] == 0.75
    assert flat["staleness/0"] == 700 and flat["staleness/1"] == 112
    assert flat["generator_versions/generator-0"] == 3 and flat["generator_versions/generator-1"] == 2
    assert flat["restarts_by_role/generator"] == 1
    assert flat["skipped"] == 0 and flat["drafter_checksums_match"] == 1  # bools as 0/1
    dropped = {"acceptance_length", "acceptance_length_window", "acceptance_floor_warning", "acceptance_by_version",
               "drafter_version", "drafter_policy_version", "threads_borrowed", "eval_versions", "eval_s", "grad_norm",
               "staleness", "generator_versions"}
    nested = {"staleness/0", "staleness/1", "generator_versions/generator-0", "generator_versions/generator-1",
              "restarts_by_role/generator"}
    assert set(flat) == (record.keys() - dropped - {"restarts_by_role", "generator_drafters"}) | nested
    assert list(flat)[:2] == ["step", "time"]  # the record's order
    assert all(type(v) in (int, float) for v in flat.values())


def test_flatten_record_is_bounded() -> None:
    record = {"step": 1, "per_generator": {f"generator-{i}": i for i in range(2 * MAX_SCALARS)}}
    flat = flatten_record(record)
    assert len(flat) == MAX_SCALARS
    assert list(flat)[:3] == ["step", "per_generator/generator-0", "per_generator/generator-1"]


def test_public_config_leaves_out_the_keys() -> None:
    config = _config()
    public = public_config(config)
    text = json.dumps(public)
    assert SERVER_KEY not in text and METRICS_KEY not in text and KEYS_DIR not in text
    assert "api_key" not in public["server"] and "keys_dir" not in public["network"]
    assert public["seed"] == 7 and public["metrics"]["wandb_project"] == "specroll-tests"
    assert public["network"]["heartbeat_timeout_s"] == config.network.heartbeat_timeout_s


def test_no_sink_enabled_does_nothing(tmp_path: Path) -> None:
    sinks = RecordSinks.open(RunConfig(), tmp_path / "run")
    sinks.write(_record(1))
    sinks.close()
    assert sinks.names == ()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("module", "key", "extra"), [("wandb", "wandb", "wandb"),
                                                      ("tensorboardX", "tensorboard", "tensorboard")])
def test_a_missing_package_is_named_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, key: str,
                                           extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    config = RunConfig(metrics=MetricsConfig(**{key: True}))
    with pytest.raises(MetricsSinkUnavailable, match=rf"metrics\.{key} = true needs the {module} package: "
                                                     rf"pip install 'specroll\[{extra}\]'"):
        RecordSinks.open(config, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_malformed_wandb_id_file_is_named(tmp_path: Path) -> None:
    assert wandb_run_id(tmp_path, "abc123") == "abc123"
    assert wandb_run_id(tmp_path, "other") == "abc123"  # kept
    (tmp_path / WANDB_ID_FILENAME).write_text("../x y\n")
    with pytest.raises(ValueError, match=r"wandb_id.txt: W&B run id '\.\./x y'; expected 1-64 letters"):
        wandb_run_id(tmp_path, "other")


def test_a_record_without_an_int_step_is_refused(tmp_path: Path) -> None:
    with RecordSinks.open(RunConfig(metrics=MetricsConfig(tensorboard=True)), tmp_path) as sinks:
        with pytest.raises(ValueError, match=r"'step' = '3'; expected the step number"):
            sinks.write({**_record(1), "step": "3"})


# --- TensorBoard ---------------------------------------------------------------------------------------


def _purge_step(events: list[object]) -> int:
    return next(e.step for e in events if e.HasField("session_log"))  # type: ignore[attr-defined]


def test_tensorboard_writes_the_scalars_and_a_restart_purges(tmp_path: Path) -> None:
    config = RunConfig(metrics=MetricsConfig(tensorboard=True))
    sinks = RecordSinks.open(config, tmp_path)
    assert sinks.names == ("tensorboard",)
    for record in (_record(1), _record(2, skipped=True, loss=SKIPPED_LOSS), _record(2)):
        sinks.write(record)
    (first,) = event_files(tmp_path / "tensorboard")  # flushed after every record, before close
    sinks.close()
    sinks.close()
    logged = scalars(first)
    assert {tag for tag, _ in logged} == set(flatten_record(_record(1)))
    assert {step for _, step in logged} == {1, 2}
    assert logged["loss", 2] == 0.25 and logged["staleness/1", 1] == 112
    losses = [v.simple_value for e in first for v in e.summary.value if v.tag == "loss"]  # type: ignore[attr-defined]
    assert losses == [0.125, 0.25]  # not the skipped batch's

    with RecordSinks.open(config, tmp_path) as restarted:  # resumed from step 1's checkpoint
        restarted.write(_record(2, loss=0.5))
    files = event_files(tmp_path / "tensorboard")
    assert sorted(_purge_step(events) for events in files) == [1, 2]
    (second,) = [events for events in files if _purge_step(events) == 2]
    assert scalars(second)["loss", 2] == 0.5


def test_a_failing_sink_is_switched_off_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    from tensorboardX.event_file_writer import EventsWriter

    calls = []

    def full_disk(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EventsWriter, "write_event", full_disk)
    with RecordSinks.open(RunConfig(metrics=MetricsConfig(tensorboard=True)), tmp_path) as sinks:
        with caplog.at_level(logging.WARNING, logger="specroll.metrics"):
            sinks.write(_record(1))
            sinks.write(_record(2))
        assert sinks.names == ()
    assert len(calls) == 1
    (warning,) = caplog.records
    assert "tensorboard sink failed at step 1" in warning.getMessage()
    assert "No space left on device" in warning.getMessage()


# --- W&B (offline) -------------------------------------------------------------------------------------


def _config() -> RunConfig:
    return RunConfig(seed=7, server=ServerConfig(api_key=SERVER_KEY), network=NetworkConfig(keys_dir=KEYS_DIR),
                     metrics=MetricsConfig(wandb=True, wandb_mode="offline", wandb_project="specroll-tests",
                                           api_key=METRICS_KEY))


@dataclass
class WandbRuns:
    run_dir: Path
    first: WandbRun
    restarted: WandbRun
    names_after_open: tuple[str, ...]
    names_at_end: tuple[str, ...]
    log: list[str]  # what the sinks logged
    leftover_processes: str


def _wandb_children() -> str:
    """This process's child processes that are wandb's service."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    return "\n".join(line for line in out.stdout.splitlines() if "wandb" in line)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def wandb_runs(tmp_path_factory: pytest.TempPathFactory) -> WandbRuns:
    """One run directory, two trainer processes: the first logs steps 1 and 2 (after a skipped batch of
    step 2), then step 2 again; the restarted one steps 2 (trained again) and 3."""
    home = tmp_path_factory.mktemp("wandb-home")
    run_dir = tmp_path_factory.mktemp("runs") / "run-a"
    with pytest.MonkeyPatch.context() as env:
        for name in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_DIR"):
            env.delenv(name, raising=False)
        env.setenv("WANDB_SILENT", "true")
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # closed: a request would fail, not leave
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(name, str(home / name.lower()))
        logger, handler = logging.getLogger("specroll.metrics"), _ListHandler()
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            with RecordSinks.open(_config(), run_dir) as sinks:
                names = sinks.names
                for record in (_record(1), _record(2, skipped=True, loss=SKIPPED_LOSS),
                               _record(2, eval_accuracy=0.5), _record(2, loss=BEHIND_LOSS)):
                    sinks.write(record)
                names_at_end = sinks.names
            with RecordSinks.open(_config(), run_dir) as sinks:
                for record in (_record(2, loss=0.5), _record(3)):
                    sinks.write(record)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        leftover = _wandb_children()
    first, restarted = sorted(p for p in (run_dir / "wandb").glob("offline-run-*") if p.is_dir())
    return WandbRuns(run_dir, read_wandb_run(first), read_wandb_run(restarted), names, names_at_end,
                     handler.messages, leftover)


@pytest.mark.integration
def test_wandb_offline_run_holds_the_records(wandb_runs: WandbRuns) -> None:
    assert wandb_runs.names_after_open == ("wandb",)
    history = wandb_runs.first.history
    assert [(h["_step"], h["step"]) for h in history] == [(1, 1), (2, 2)]  # W&B's step is the record's
    internal = {"_step", "_runtime", "_timestamp"}
    assert {k for k in history[0] if k not in internal} == set(flatten_record(_record(1)))
    assert history[1]["loss"] == 0.25 and history[1]["eval_accuracy"] == 0.5
    assert history[1]["staleness/1"] == 112 and history[1]["generator_versions/generator-0"] == 2
    assert wandb_runs.first.config["seed"] == 7


@pytest.mark.integration
def test_wandb_leaves_out_the_skipped_record(wandb_runs: WandbRuns) -> None:
    assert all(h["loss"] != SKIPPED_LOSS for run in (wandb_runs.first, wandb_runs.restarted) for h in run.history)


@pytest.mark.integration
def test_wandb_restart_resumes_the_same_run(wandb_runs: WandbRuns) -> None:
    run_id = (wandb_runs.run_dir / WANDB_ID_FILENAME).read_text().strip()
    assert wandb_runs.first.run_id == wandb_runs.restarted.run_id == run_id
    assert wandb_runs.restarted.directory.name.startswith("offline-run-")
    assert [(h["_step"], h["step"]) for h in wandb_runs.restarted.history] == [(2, 2), (3, 3)]
    assert wandb_runs.restarted.history[0]["loss"] == 0.5


@pytest.mark.integration
def test_wandb_stores_no_secret(wandb_runs: WandbRuns) -> None:
    assert "api_key" not in wandb_runs.first.config["server"]  # type: ignore[operator]
    for path in (wandb_runs.run_dir / "wandb").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert all(s.encode() not in data for s in (SERVER_KEY, METRICS_KEY, KEYS_DIR)), path


@pytest.mark.integration
def test_wandb_leaves_no_service_process(wandb_runs: WandbRuns) -> None:
    assert wandb_runs.leftover_processes == ""


@pytest.mark.integration
def test_wandb_leaves_out_a_step_it_has(wandb_runs: WandbRuns) -> None:
    assert all(h["loss"] != BEHIND_LOSS for h in wandb_runs.first.history)
    assert wandb_runs.names_at_end == ("wandb",)  # left out, not failed
    (said,) = wandb_runs.log  # once, by us rather than by W&B's own log
    assert said.startswith("metrics: W&B already has step 2 (its next step is 3)")
