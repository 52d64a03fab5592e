"""A role's process as the launcher runs it: started in its own process group (``pgid == pid``)
with stdout and stderr appended to its log, observed without being reaped, signalled by group.

A child that exits is observed with ``waitid(WNOWAIT)``: its zombie keeps the pid — and with it the
process-group id — reserved, so signalling that group can only reach processes the launcher started
(and anything they left behind in their group). On Linux each child also gets
``PR_SET_PDEATHSIG = SIGKILL``, so even a SIGKILLed launcher leaves no role running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.role_fork import ForkedProcess, Forker, fork_role, pdeathsig_preexec


@runtime_checkable
class RemoteProcess(Protocol):
    """A role's process that a host process starts and watches for the launcher (a Ray actor on some
    node: ``ray_cluster.RayProcess``). ``pid`` is the pid on that node; the host observes the exit
    without reaping (``poll``), signals the process group (``killpg``) and reaps when told (``wait``)."""

    pid: int

    def poll(self) -> int | None: ...

    def killpg(self, sig: signal.Signals) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class RoleProcess:
    """One started role: its process (leader of its own process group) and its log."""

    name: str
    popen: subprocess.Popen[bytes] | ForkedProcess | RemoteProcess
    log_path: Path
    exit_code: int | None = None
    """Set once the process is seen to have exited (``-N``: killed by signal N), before it is reaped."""
    reaped: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid


START_HEADER = "==== specroll launch: "
"""How the line that :func:`start_role` writes into a role's log before each start begins."""
_START_LINE = re.compile(re.escape(START_HEADER) + r"\S+ (started|forked) \d{4}-\d\d-\d\d ")


def start_role(name: str, module_args: list[str], log_path: Path, forker: Forker | None = None,
               cwd: Path | None = None, default_signals: bool = False,
               env: Mapping[str, str] | None = None) -> RoleProcess:
    """Start ``python -m module_args...`` as ``name`` in its own process group, stdout and stderr
    appended to ``log_path`` after a header line with the start time: a fresh interpreter (in ``cwd``,
    default this process's), or with ``forker`` a fork of this process that has the modules imported
    already (``role_fork.py``). ``default_signals``: the fresh interpreter starts with no signal
    blocked or ignored, whatever this process has (a Ray worker blocks SIGINT and ignores SIGQUIT,
    which a child would otherwise inherit through ``exec``). ``env``: variables set (over this
    process's environment) in the role's."""
    if forker is not None and not forker.usable():
        forker = None
    how = "forked" if forker is not None else "started"
    with log_path.open("ab") as log:
        log.write(f"{START_HEADER}{name} {how} {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    if forker is not None:
        return RoleProcess(name, fork_role(forker, module_args, log_path, name, env), log_path)
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", *module_args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            process_group=0, close_fds=True, cwd=cwd, env={**os.environ, **env} if env else None,
            preexec_fn=_with_default_signals(pdeathsig_preexec()) if default_signals else pdeathsig_preexec(),
        )
    return RoleProcess(name, popen, log_path)


def _with_default_signals(then: Callable[[], None] | None) -> Callable[[], None]:
    """A ``preexec_fn``: unblock every signal and set every catchable one to its default disposition
    (``exec`` keeps the mask and ignored signals, resets only handled ones), then run ``then``."""
    catchable = sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        for sig in catchable:
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                continue  # reserved by the C library (the real-time signals it uses)
        if then is not None:
            then()

    return preexec


def describe_exit(code: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"`` for a Popen-style return code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def tail(path: Path, lines: int = 20, max_bytes: int = 16384) -> str:
    """The last ``lines`` lines of a role's log (``""`` when missing), each indented by two spaces,
    from its latest start's header line on (a log is appended across starts and launches: an
    earlier one's lines are not this process's)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    rows = text.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(rows) if _START_LINE.match(line)]
    rows = rows[starts[-1]:] if starts else rows
    return "\n".join("  " + line for line in rows[-lines:])


def death_error(proc: RoleProcess, code: int, when: str = "") -> LaunchError:
    """The error that ends the run because ``proc`` exited with ``code`` (``when``: e.g. ``"before
    writing its endpoint"``), with the last lines of its log."""
    when = f" {when}" if when else ""
    return LaunchError(f"{proc.name} (pid {proc.pid}) {describe_exit(code)}{when}; stopping the run. "
                       f"Last lines of {proc.log_path}:", detail=tail(proc.log_path))


def observe_exit(proc: RoleProcess) -> int | None:
    """The exit code if ``proc`` has exited, without reaping it (its pid and pgid stay reserved)."""
    if proc.exit_code is not None:
        return proc.exit_code
    if isinstance(proc.popen, RemoteProcess):  # its host observes it, without reaping
        proc.exit_code = proc.popen.poll()
        return proc.exit_code
    if not hasattr(os, "waitid"):  # not Linux: poll() reaps; the pgid is then no longer reserved
        proc.exit_code = proc.popen.poll()
        proc.reaped = proc.exit_code is not None
        return proc.exit_code
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped (cannot happen unless someone else waited on it)
        proc.exit_code = proc.popen.poll()
        proc.reaped = True
        return proc.exit_code
    if info is None or info.si_pid == 0:
        return None
    proc.exit_code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    return proc.exit_code


def group_members(pgid: int) -> set[int] | None:
    """The live (not zombie) processes in process group ``pgid``, read from ``/proc``; None where
    there is no ``/proc`` (not Linux)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return None
    members = set()
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            members.add(int(stat.parent.name))
    return members


def reap_if_alone(proc: RoleProcess) -> bool:
    """Reap ``proc`` — exited, observed, not reaped — once nothing is left in its process group, so its
    zombie does not stay until the launcher exits; True when reaped. Only then: while a member is
    left, the zombie keeps the group id reserved for :func:`killpg`. A role on another host (Ray) is
    reaped by its host at teardown, and off Linux :func:`observe_exit` reaped it already."""
    if proc.reaped or proc.exit_code is None or isinstance(proc.popen, RemoteProcess):
        return proc.reaped
    members = group_members(proc.pid)
    if members is None or members:
        return False
    proc.popen.wait()  # exited (observed above): returns at once
    proc.reaped = True
    return True


def killpg(proc: RoleProcess, sig: signal.Signals) -> None:
    """Signal the process group ``proc`` leads; valid while ``proc`` is unreaped (its pid is reserved)."""
    if proc.reaped:
        return
    if isinstance(proc.popen, RemoteProcess):  # its host signals the group on its node
        proc.popen.killpg(sig)
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # the group is empty: nothing left to stop


def terminate(procs: list[RoleProcess], grace_s: float, poll_s: float,
              give_up: Callable[[], bool]) -> list[RoleProcess]:
    """SIGTERM the process group of each of ``procs`` and wait up to ``grace_s`` (checking every
    ``poll_s``) for them to exit, or until ``give_up()``; return those still running."""
    for p in procs:
        killpg(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    live = [p for p in procs if observe_exit(p) is None]
    while live and time.monotonic() < deadline and not give_up():
        time.sleep(poll_s)
        live = [p for p in live if observe_exit(p) is None]
    return live
