"""Trainer checkpoints under storage faults: a damaged newest checkpoint (a byte flipped, a file cut
short or deleted) is passed over for the one before, in one log line; none usable is refused naming
each file; a checkpoint named explicitly that fails its checksums loads nothing; a full disk skips a
checkpoint with one line and the run resumes from the last good one; a SIGKILL in the middle of a
write leaves a checkpoint a resume takes. Tiny random-weight models; the faults are real
(``helpers/storage_faults.py``)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path

import anyio
import pytest
import torch
from helpers.storage_faults import DISK_FULL, can_mount, disk_folder, run_child, run_to_stop
from helpers.timeouts import guard
from helpers.trainer_runs import free_port, generators, metrics, run_config, wait_for

from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.preflight import preflight
from specroll.actors.trainer.checkpoint import CHECKPOINT_DIRNAME, MODEL_FILE, TrainerState, load_trainer_checkpoint
from specroll.actors.trainer.checkpoint_schedule import CheckpointSchedule
from specroll.actors.trainer.process import run_trainer
from specroll.actors.trainer.setup import TrainerError, TrainerSetup, load_setup
from specroll.engine.loaders.errors import ChecksumError
from specroll.engine.loaders.sealed import CHECKSUMS_FILE

PREV = f"{CHECKPOINT_DIRNAME}.prev"


def state(step: int, seed: int) -> TrainerState:
    return TrainerState(step=step, policy_version=step, prompt_cursor=4 * step, seed=seed)


def save_steps(setup: TrainerSetup, run: Path, seed: int, *steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints of ``steps`` in order, each of other weights; the weights of each."""
    saved = {}
    for step in steps:
        with torch.no_grad():
            for p in setup.policy.model.parameters():  # type: ignore[attr-defined]
                p.add_(0.01)
        saved[step] = {k: v.clone() for k, v in setup.policy.full_weights().items()}
        setup.policy.save(run, state(step, seed))
    return saved


def damage(file: Path, how: str) -> None:
    if how == "flip a byte":
        raw = bytearray(file.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        file.write_bytes(bytes(raw))
    elif how == "cut short":
        os.truncate(file, file.stat().st_size // 2)
    else:
        file.unlink()


# ---- a damaged checkpoint at load ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip a byte", "cut short", "delete"])
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(tiny_checkpoint, tmp_path: Path,
                                                                       capsys, how: str) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_checkpoint("llama"), steps=5)
    weights = save_steps(load_setup(config), run, config.seed, 1, 2)
    damage(run / CHECKPOINT_DIRNAME / MODEL_FILE, how)

    setup = load_setup(config)
    assert (setup.resumed_from, setup.state) == (run / PREV, state(1, config.seed))
    assert all(torch.equal(setup.policy.full_weights()[k], v) for k, v in weights[1].items())
    [refused] = setup.refused
    assert refused.startswith(f"{run / CHECKPOINT_DIRNAME / MODEL_FILE}: "), refused
    # the launcher checks sizes only (the trainer reads every byte): it sees a file cut short or gone
    capsys.readouterr()
    assert preflight(config) is None
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specroll launch: resuming")]
    if how == "flip a byte":
        assert said == [f"specroll launch: resuming from {run / CHECKPOINT_DIRNAME} (step 2 of 5; the metrics of "
                        "later steps are replaced)"]
    else:
        assert len(said) == 1 and said[0].startswith(f"specroll launch: resuming from {run / PREV} (step 1 of 5;")
        assert f"; refused {run / CHECKPOINT_DIRNAME / MODEL_FILE}: " in said[0]


def test_with_no_usable_checkpoint_the_trainer_and_the_launcher_refuse_naming_each_file(tiny_checkpoint,
                                                                                       tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_checkpoint("llama"), steps=5)
    save_steps(load_setup(config), run, config.seed, 1, 2)
    damage(run / CHECKPOINT_DIRNAME / MODEL_FILE, "cut short")
    damage(run / PREV / "trainer_state.json", "delete")
    with pytest.raises(TrainerError) as refused:
        load_setup(config)
    assert refused.value.exit_code == 2  # refused: the launcher does not restart it to fail again
    message = str(refused.value)
    assert f"{run / CHECKPOINT_DIRNAME / MODEL_FILE}: " in message
    assert f"{run / PREV / 'trainer_state.json'}: " in message
    assert "to start again from step 0" in message
    with pytest.raises(LaunchError, match=re.escape(f"no usable checkpoint in {run}; refused {run}/checkpoint/")):
        preflight(config)


def test_a_checkpoint_named_explicitly_that_fails_its_checksums_loads_nothing(tiny_checkpoint, tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_checkpoint("llama"))
    setup = load_setup(config)
    save_steps(setup, run, config.seed, 1)
    damage(run / CHECKPOINT_DIRNAME / "optimizer.safetensors", "flip a byte")
    model, optimizer = setup.policy.model, setup.policy.optimizer  # type: ignore[attr-defined]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ChecksumError) as refused:
        load_trainer_checkpoint(run / CHECKPOINT_DIRNAME, model, optimizer)
    assert refused.value.path == run / CHECKPOINT_DIRNAME / "optimizer.safetensors"
    assert "changed after it was written" in str(refused.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing half-loaded


def test_a_checkpoint_written_before_checksums_still_loads_with_a_warning(
        tiny_checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_checkpoint("llama"))
    save_steps(load_setup(config), run, config.seed, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    (run / CHECKPOINT_DIRNAME / CHECKSUMS_FILE).unlink()
    setup = load_setup(config)
    assert (setup.resumed_from, setup.state.step, setup.refused) == (run / CHECKPOINT_DIRNAME, 1, [])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{run / CHECKPOINT_DIRNAME} has no {CHECKSUMS_FILE}: its files are read unchecked (a checkpoint from "
        "before checksums, or one whose list was removed)"]


def test_a_damaged_checkpoint_written_before_checksums_is_passed_over_too(tiny_checkpoint, tmp_path: Path) -> None:
    """Without checksums.json a file cut short fails to load (CheckpointError): refused as a checksum
    failure is, for the one before — not a trainer failing at every restart."""
    run = tmp_path / "run"
    config = run_config(run, tiny_checkpoint("llama"), steps=5)
    save_steps(load_setup(config), run, config.seed, 1, 2)
    (run / CHECKPOINT_DIRNAME / CHECKSUMS_FILE).unlink()
    damage(run / CHECKPOINT_DIRNAME / MODEL_FILE, "cut short")
    setup = load_setup(config)
    assert (setup.resumed_from, setup.state.step) == (run / PREV, 1)
    assert len(setup.refused) == 1 and str(run / CHECKPOINT_DIRNAME / MODEL_FILE) in setup.refused[0], setup.refused


@pytest.mark.parametrize("what", ["checkpoint", "drafter"])
def test_a_run_folder_that_is_a_file_is_refused_at_launch(tiny_checkpoint, tmp_path: Path, what: str) -> None:
    """Each checkpoint (drafter version) would fail to be written and the trainer be restarted for
    nothing: the launcher refuses it at once, naming it."""
    run = tmp_path / "run"
    config = run_config(run, tiny_checkpoint("llama"), steps=5)
    run.mkdir()
    (run / what).write_text("hi")
    with pytest.raises(LaunchError, match=re.escape(f"{run / what}: exists and is not a folder")):
        preflight(config)


# ---- a real trainer resuming ---------------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.integration
@pytest.mark.anyio
async def test_the_trainer_resumes_from_the_checkpoint_before_a_damaged_one_in_one_line(
        tiny_checkpoint, tmp_path: Path, caplog) -> None:
    model, run, port = tiny_checkpoint("llama"), tmp_path / "run", free_port()
    config = run_config(run, model, steps=3, network__trainer_port=port, generator__count=1)
    save_steps(load_setup(config), run, config.seed, 1, 2)
    damage(run / CHECKPOINT_DIRNAME / MODEL_FILE, "flip a byte")
    result: dict[str, int] = {}

    async def trainer() -> None:
        result["code"] = await run_trainer(config)

    caplog.set_level(logging.INFO, logger="specroll.trainer")
    with generators(f"tcp://127.0.0.1:{port}", model, tmp_path, count=1) as procs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            await wait_for(lambda: "code" in result, guard(120), "the trainer to finish", procs)
    assert result["code"] == 0
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines == [f"resuming from {run / PREV}: step 1, policy version 1; refused "
                     f"{run / CHECKPOINT_DIRNAME / MODEL_FILE}: " + lines[0].split(f"{MODEL_FILE}: ", 1)[1]]
    assert [r.levelname for r in caplog.records if "refused" in r.getMessage()] == ["WARNING"]
    assert [m["step"] for m in metrics(run)] == [2, 3]
    # the launcher checked sizes only and said "resuming from checkpoint": the first line tells it otherwise
    warning = metrics(run)[0].get("checkpoint_warning", "")
    damaged = run / CHECKPOINT_DIRNAME / MODEL_FILE
    assert warning.startswith(f"resumed from {run / PREV} (step 1): refused {damaged}: "), metrics(run)[0]
    assert "checkpoint_warning" not in metrics(run)[1]
    assert load_setup(config).state.step == 3  # the final checkpoint, over the damaged one


# ---- a full disk -----------------------------------------------------------------------------------

FULL_DISK_TRAINER = """
import json, logging, sys
from pathlib import Path
from helpers.storage_faults import make_disk_full
from helpers.trainer_runs import run_config
from specroll.actors.trainer.checkpoint import TrainerState
from specroll.actors.trainer.checkpoint_schedule import CheckpointSchedule
from specroll.actors.trainer.setup import TrainerError, load_setup

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
run, model, fault = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
config = run_config(run, model, steps=3, trainer__checkpoint_every=1)
setup = load_setup(config)
checkpoints = CheckpointSchedule(config, 0, None)

def state(step):
    return TrainerState(step=step, policy_version=step, prompt_cursor=4 * step, seed=config.seed)

checkpoints.write(setup.policy.save, run, state(1))
make_disk_full(fault, run)
checkpoints.write(setup.policy.save, run, state(2))
record = {}
checkpoints.add_warning(record)
print("RECORD " + json.dumps(record))
try:
    checkpoints.write(setup.policy.save, run, state(3), final=True)
except TrainerError as e:
    print(f"FINAL {e.exit_code} {e}")
"""


@pytest.mark.integration
@pytest.mark.parametrize("fault", sorted(DISK_FULL))
def test_a_full_disk_skips_a_checkpoint_in_one_line_and_the_run_resumes_from_the_last_good(
        tiny_checkpoint, tmp_path: Path, fault: str) -> None:
    """The trainer's checkpoint code (``CheckpointSchedule.write`` of ``Policy.save``) in a child
    process whose disk fills after its first checkpoint."""
    if fault == "ENOSPC" and not can_mount():
        pytest.skip("ENOSPC needs a tmpfs, which only root with mount rights makes; EFBIG runs here instead")
    model, run = tiny_checkpoint("llama"), tmp_path / "run"
    with disk_folder(fault, run, 16 << 20):
        done = run_child(FULL_DISK_TRAINER, run, model, fault)
        assert done.returncode == 0, done.stderr[-3000:]
        out = done.stdout.splitlines()
        why = os.strerror(DISK_FULL[fault])
        skipped = (f"checkpoint of step 2 not written ({MODEL_FILE}: {why}); training goes on, a resume starts "
                   f"from step 1 ({run / CHECKPOINT_DIRNAME}), next try at step 3")
        assert [line for line in out if line.startswith("WARNING")] == [f"WARNING {skipped}"], out
        assert f"RECORD {json.dumps({'checkpoint_warning': skipped})}" in out
        assert (f"FINAL 1 the final checkpoint of step 3 was not written ({MODEL_FILE}: {why}); a resume starts "
                f"from step 1 ({run / CHECKPOINT_DIRNAME}); free space and launch again to train the steps after "
                "it") in out, out
        assert sorted(p.name for p in run.iterdir() if p.name != ".filler") == [CHECKPOINT_DIRNAME]  # nothing half
        setup = load_setup(run_config(run, model, steps=3))
        assert (setup.resumed_from, setup.state.step, setup.refused) == (run / CHECKPOINT_DIRNAME, 1, [])



@pytest.mark.parametrize("final", [False, True], ids=["mid-run", "final"])
@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EROFS], ids=errno.errorcode.get)
def test_a_checkpoint_the_file_system_refuses_ends_the_trainer_as_a_refusal(tmp_path: Path, code: int,
                                                                              final: bool) -> None:
    """A read-only or immutable run directory fails every try the same: exit 2 at once (the launcher
    does not restart a refusal), one line naming the file and the checkpoint a resume starts from."""
    config = run_config(tmp_path / "run", tmp_path / "model", steps=3, trainer__checkpoint_every=1)
    schedule = CheckpointSchedule(config, 1, tmp_path / "run" / CHECKPOINT_DIRNAME)
    target = tmp_path / "run" / CHECKPOINT_DIRNAME

    def save(run: Path, state: TrainerState) -> Path:
        raise OSError(code, os.strerror(code), str(target))

    with pytest.raises(TrainerError) as refused:
        schedule.write(save, tmp_path / "run", TrainerState(step=2, policy_version=2, prompt_cursor=8, seed=0),
                       final=final)
    assert refused.value.exit_code == 2
    assert str(refused.value) == (f"the checkpoint of step 2 cannot be written: {target}: {os.strerror(code)} "
                                  f"(expected a writable run directory); a resume starts from step 1 ({target}); "
                                  "make it writable and launch again")


# ---- a SIGKILL in the middle of a checkpoint ---------------------------------------------------------

KILLED_TRAINER = """
import sys
from pathlib import Path
from helpers.storage_faults import stop_before_call
from helpers.trainer_runs import run_config
from specroll.actors.trainer.checkpoint import TrainerState
from specroll.actors.trainer.setup import load_setup

run, model, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
config = run_config(run, model)
setup = load_setup(config)
stop_before_call(n, ("rename", "replace"))
setup.policy.save(run, TrainerState(step=3, policy_version=3, prompt_cursor=12, seed=config.seed))
"""


@pytest.mark.integration
def test_a_trainer_killed_in_the_middle_of_a_checkpoint_resumes_from_a_complete_one(tiny_checkpoint,
                                                                                  tmp_path: Path) -> None:
    """The trainer's checkpoint write (``Policy.save``), in a child process SIGKILLed before each of
    its renames in turn — before the previous checkpoint goes, with the new one's files written but
    not listed, listed but not in place, between the two renames of the swap — and after the last:
    a resume takes step 2 or 3, never refuses, and the next checkpoint leaves nothing behind."""
    model = tiny_checkpoint("llama")
    kills, n = 0, 0
    while True:
        n += 1
        run = tmp_path / f"run-{n}"
        config = run_config(run, model)
        save_steps(load_setup(config), run, config.seed, 1, 2)
        stopped = run_to_stop(KILLED_TRAINER, run, model, n)
        setup = load_setup(config)
        assert setup.refused == [] and setup.state.step in (2, 3) and setup.resumed_from is not None, n
        if not stopped:
            assert setup.state.step == 3
            break
        kills += 1
        setup.policy.save(run, state(4, config.seed))
        assert sorted(p.name for p in run.iterdir()) == [CHECKPOINT_DIRNAME, PREV], n  # staging and trash gone
        assert load_setup(config).state.step == 4
    assert kills == 4
