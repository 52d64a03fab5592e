"""The drafter's warm start at launch (``drafter.warm_start_minutes`` > 0): before the trainer starts,
the launcher finds the run's warm-start head in the cache (``jobs/drafter_cache.py``; only the key is
computed here: no model is loaded) or makes it in a child process, ``specroll drafter init --config
RUN_DIR/config.toml`` with half the cores (its own process group, output in ``RUN_DIR/logs/warm-start.log``,
stopped with the run on Ctrl-C), and the run's resolved config then names the head as ``drafter.path``,
so the generators serve it from the first step and the drafter trainer trains on from it.

No warm start is made when the drafter trainer does not run (``drafter.enabled`` false, or
``trainer.mode = "sync"``), when ``drafter.path`` is set (it is the warm start), or when the run
directory holds the drafter trainer's saved drafter (a resumed run keeps its own, ``RUN_DIR/drafter``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from specroll.actors.config import RunConfig
from specroll.actors.drafter_trainer.actor import save_dir
from specroll.actors.jobs.drafter_cache import (
    cache_dir_of,
    lookup,
    make_cache_dir,
    training_prompts,
    warm_start_key,
)
from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.role_process import RoleProcess, death_error, killpg, observe_exit, start_role
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.drafter.eagle_files import WEIGHTS_FILE
from specroll.engine.loaders.checkpoint import CheckpointError
from specroll.engine.loaders.errors import ChecksumError
from specroll.engine.loaders.sealed import check_folder, read_newest

WARM_START_ROLE = "warm-start"
"""The child's name in the launcher's lines and its log's (``RUN_DIR/logs/warm-start.log``)."""


def resolve_warm_start(config: RunConfig, make: Callable[[], None], say: Callable[[str], None],
                       progress: Path | None = None) -> RunConfig:
    """``config`` with its warm-start head as ``drafter.path`` (module docstring), found in the cache
    or made by ``make`` (which must leave it there); unchanged when no warm start is made. Says a
    line when it starts making one (with ``progress``, the log to follow), and one when it has the
    head: hit or miss, the seconds it took and the folder.

    Raises:
        LaunchError: the prompts or the model do not load, or the cache folder cannot be a folder
            (exit 2), or ``make`` left no head in the cache.
    """
    d = config.drafter
    if not d.warm_start_minutes or not config.runs_drafter_trainer():
        return config
    if d.path is not None:
        say(f"drafter warm start: none made, drafter.path = {d.path!r} is the warm start")
        return config
    saved = _own_drafter(config)
    if saved is not None:
        say(f"drafter warm start: none made, the run's own drafter in {saved} is the warm start (a resumed run)")
        return config
    cache, start = cache_dir_of(config), time.monotonic()
    try:
        key = warm_start_key(config, training_prompts(config), d.warm_start_minutes, d.warm_start_rollouts).digest()
    except ValueError as e:  # PromptFileError too
        raise LaunchError(f"task: {e}", code=EXIT_REFUSED) from None
    except CheckpointError as e:
        raise LaunchError(f"model.name: {e}", code=EXIT_REFUSED) from None
    found = lookup(cache, key)
    hit = found is not None
    if found is not None:
        try:
            check_folder(found)
        except ChecksumError as e:
            raise LaunchError(f"cached drafter {e}; remove {found} to make it again", code=EXIT_REFUSED) from None
    if found is None:
        try:  # before anything is made: a cache that cannot be written would lose the head at the end
            make_cache_dir(cache)
        except OSError as e:
            raise LaunchError(f"drafter.warm_start_cache_dir: cache folder {cache}: {e.strerror or e}; expected a "
                              "writable directory", code=EXIT_REFUSED) from None
        say(f"drafter warm start: cache miss (key {key} in {cache}): making it, {d.warm_start_rollouts} rollouts "
            f"and {d.warm_start_minutes:g} CPU-minutes of training"
            + (f" (progress in {progress})" if progress is not None else ""))
        make()
        found = lookup(cache, key)
        if found is None:
            raise LaunchError(f"the drafter warm start left no head at {cache / key}; expected the folder "
                              "'specroll drafter init' writes")
    say(f"drafter warm start: cache {'hit' if hit else 'miss'}, {time.monotonic() - start:.1f} s: {found}")
    return msgspec.structs.replace(config, drafter=msgspec.structs.replace(d, path=str(found)))


def make_in_child(config_path: Path, log_path: Path, threads: int, processes: list[RoleProcess],
                  check_signal: Callable[[], None], poll_s: float) -> None:
    """Run ``specroll drafter init --config CONFIG_PATH --threads THREADS`` as a fresh interpreter in its
    own process group (appended to ``processes``, which the launcher stops at teardown) and wait for
    it, calling ``check_signal`` every ``poll_s``.

    Once it exited 0 its process group is emptied and it is reaped (no zombie for the run's length).

    Raises:
        LaunchError: it exited non-zero (2: refused its inputs), with the last lines of its log; or
            ``check_signal``'s, when the launcher was signalled.
    """
    proc = start_role(WARM_START_ROLE, ["specroll.actors.cli", "drafter", "init", "--config", str(config_path),
                                        "--threads", str(threads)], log_path)
    processes.append(proc)
    while (code := observe_exit(proc)) is None:
        check_signal()
        time.sleep(poll_s)
    if code != 0:
        error = death_error(proc, code)
        raise LaunchError(str(error), code=EXIT_REFUSED if code == EXIT_REFUSED else error.code, detail=error.detail)
    killpg(proc, signal.SIGKILL)  # anything it left in its group (its pid is still reserved: unreaped)
    proc.popen.wait()
    proc.reaped = True


def _own_drafter(config: RunConfig) -> Path | None:
    """The drafter the run's drafter trainer saved (``RUN_DIR/drafter``, else ``RUN_DIR/drafter.prev``)
    whose files pass their checksums, or None."""

    def usable(folder: Path) -> None:
        check_folder(folder)
        if not (folder / WEIGHTS_FILE).is_file():
            raise ChecksumError(folder / WEIGHTS_FILE, "missing")

    return read_newest(save_dir(config), usable).path
