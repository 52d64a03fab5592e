"""The launcher's drafter warm start: when it is made, found in the cache, or not made at all, and
the head it names as ``drafter.path``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.warm_start import warm_start_config

from specroll.actors.jobs.drafter_init import make_warm_start
from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.warm_start import make_in_child, resolve_warm_start
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.drafter.eagle_head import EagleHead


def _never() -> None:
    pytest.fail("no warm start should be made here")


def test_the_first_launch_makes_it_and_the_next_finds_it(tiny_llama: Path, tmp_path: Path) -> None:
    config = warm_start_config(tiny_llama, tmp_path / "run", tmp_path / "cache")
    made: list[Path] = []

    def make() -> None:  # the job itself, in this process
        made.append(make_warm_start(config, config.drafter.warm_start_minutes,
                                    config.drafter.warm_start_rollouts, tmp_path / "cache", threads=1,
                                    say=lambda _: None).path)

    lines: list[str] = []
    first = resolve_warm_start(config, make, lines.append, progress=tmp_path / "warm-start.log")
    assert first.drafter.path == str(made[0]) and len(made) == 1
    assert lines[0].endswith(f"(progress in {tmp_path / 'warm-start.log'})"), lines
    EagleHead.load(first.drafter.path)
    assert "cache miss" in lines[-1] and lines[-1].endswith(str(made[0])), lines
    assert first.served_drafter() == first.drafter.path  # the generators serve it from the first step

    lines.clear()
    second = resolve_warm_start(config, _never, lines.append)
    assert second.drafter.path == first.drafter.path
    assert len(lines) == 1 and "cache hit" in lines[0], lines


@pytest.mark.parametrize("case", ["off", "disabled", "sync", "path", "resumed"])
def test_no_warm_start_is_made_when_the_run_has_one_or_trains_no_drafter(tiny_llama: Path, tmp_path: Path,
                                                                        case: str) -> None:
    extra = {"off": ["drafter.warm_start_minutes=0"], "disabled": ["drafter.enabled=false"],
             "sync": ["trainer.mode=\"sync\""], "path": [f"drafter.path=\"{tmp_path / 'mine'}\""],
             "resumed": []}[case]
    config = warm_start_config(tiny_llama, tmp_path / "run", tmp_path / "cache", *extra)
    if case == "resumed":  # the drafter trainer saved a version in this run directory
        (tmp_path / "run" / "drafter").mkdir(parents=True)
        (tmp_path / "run" / "drafter" / "model.safetensors").write_bytes(b"")
    lines: list[str] = []
    assert resolve_warm_start(config, _never, lines.append) is config
    said = {"path": "drafter.path", "resumed": "resumed"}
    assert (case in said) == bool(lines) and all(said[case] in line for line in lines), lines


def test_a_make_that_leaves_no_head_ends_the_launch(tiny_llama: Path, tmp_path: Path) -> None:
    config = warm_start_config(tiny_llama, tmp_path / "run", tmp_path / "cache")
    with pytest.raises(LaunchError, match="left no head"):
        resolve_warm_start(config, lambda: None, lambda _: None)


def test_a_cache_folder_that_cannot_be_one_is_refused_before_anything_is_made(tiny_llama: Path,
                                                                              tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    for cache in (tmp_path / "afile", tmp_path / "afile" / "below"):
        config = warm_start_config(tiny_llama, tmp_path / "run", cache)
        lines: list[str] = []
        with pytest.raises(LaunchError, match=f"drafter.warm_start_cache_dir: cache folder {cache}") as info:
            resolve_warm_start(config, _never, lines.append)
        assert info.value.code == EXIT_REFUSED and lines == []  # not even "making it"


def test_bad_prompts_are_refused_before_anything_is_made(tiny_llama: Path, tmp_path: Path) -> None:
    config = warm_start_config(tiny_llama, tmp_path / "run", tmp_path / "cache",
                               f"task.prompts=\"{tmp_path / 'missing.jsonl'}\"")
    with pytest.raises(LaunchError, match=r"missing\.jsonl") as info:
        resolve_warm_start(config, _never, lambda _: None)
    assert info.value.code == EXIT_REFUSED


def _no_signal() -> None:
    pass


@pytest.mark.integration
def test_the_launcher_makes_it_in_a_child_process(tiny_llama: Path, tmp_path: Path) -> None:
    from specroll.actors.config import write_resolved

    config = warm_start_config(tiny_llama, tmp_path / "run", tmp_path / "cache")
    (tmp_path / "run").mkdir()
    path = write_resolved(config)
    log, processes = tmp_path / "warm-start.log", []
    resolved = resolve_warm_start(config, lambda: make_in_child(path, log, 1, processes, _no_signal, 0.05),
                                  lambda _: None)
    assert len(processes) == 1 and processes[0].exit_code == 0  # one specroll drafter init, in its own group
    assert processes[0].reaped  # no zombie for the run's length
    with pytest.raises(ChildProcessError):
        os.waitpid(processes[0].pid, os.WNOHANG)
    assert processes[0].pid != os.getpgid(0)
    assert "cache miss, made in" in log.read_text() and resolved.drafter.path in log.read_text()
    EagleHead.load(resolved.drafter.path)


def test_a_failed_start_shows_its_own_log_lines_not_an_earlier_launchs(tmp_path: Path) -> None:
    from specroll.actors.launch.role_process import START_HEADER, tail

    log = tmp_path / "warm-start.log"  # appended across launches, a header before each start
    log.write_text(f"{START_HEADER}warm-start started 2026-12-06 10:00:00\nerror: the earlier launch's\n"
                   f"{START_HEADER}warm-start started 2026-12-06 11:00:00\nerror: this one's\n")
    assert "this one's" in tail(log) and "earlier" not in tail(log)
    log.write_text("no header: every line\nsecond\n")
    assert tail(log) == "  no header: every line\n  second"
