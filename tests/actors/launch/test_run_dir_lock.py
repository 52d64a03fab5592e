"""The run directory's lock (``launch.lock``, ``preflight.take_lock``): one launcher per run
directory, a stale lock taken over, a directory that cannot be written refused in one line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from helpers.launch import children_of, finish, launch, write_config

from specroll.actors.launch.errors import LaunchError


@pytest.mark.integration
def test_a_run_dir_in_use_is_refused_and_a_finished_run_starts_nothing(tmp_path: Path, tiny_checkpoint) -> None:
    config = write_config(tmp_path, tiny_checkpoint(), steps=3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "launch.lock").write_text(str(os.getpid()))  # a live launcher holds it
    code, _, err = finish(launch(tmp_path, config))
    assert code == 2 and "in use by the launcher with pid" in err, err
    (run_dir / "launch.lock").write_text("999999999")  # a stale lock is taken over...
    (run_dir / "checkpoint").mkdir()
    (run_dir / "checkpoint" / "trainer_state.json").write_text('{"step": 3}')  # ...and the run is already done
    before = children_of(os.getpid())
    code, _, err = finish(launch(tmp_path, config))
    assert code == 0 and "nothing to train" in err and not (run_dir / "pids.json").exists(), err
    assert children_of(os.getpid()) <= before


def test_a_run_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is the launcher's first write: a read-only or immutable run directory (EACCES, EPERM
    even for root) is a LaunchError naming it, not a traceback."""
    from specroll.actors.launch import preflight

    def refuse(path: object, *args: object) -> int:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(preflight.os, "open", refuse)
    with pytest.raises(LaunchError, match=r"run_dir='.*/run': cannot write the run directory \(Operation not "
                                          r"permitted\), expected a writable directory"):
        preflight.take_lock(tmp_path / "run" / "launch.lock")
