"""Starting a role by forking the launcher (``[launch] fork_roles``, Linux): the launcher imports
torch and the role modules once, and each start or restart of a role is an ``os.fork()`` that runs
the role's ``__main__`` as ``python -m`` would, instead of a fresh interpreter importing torch again.

Measured on 2 cores (docs/benchmarks.md, "Chaos"): a fresh ``python -m specroll.actors.generator`` spends about
3 CPU-seconds on imports — torch and specroll (~1.8 s) and ``torch._dynamo`` (~1 s, which torch
imports lazily when the model is built on the meta device) — against ~0.1 s to load a tiny model; on
a machine the run already saturates, that is most of a restart's cost. A forked role starts with
everything imported.

What makes the fork safe, and the same as a fresh process for the role:

* **No OpenMP team in the launcher.** GNU OpenMP (which torch's CPU wheels use) is not fork-safe: a
  child forked after its parent ran a parallel region hangs at its own first one. The launcher pins
  torch to one thread (:func:`prepare`) before it touches a tensor (the preflight may load a
  drafter), so no team is ever created; the child sets torch's default thread count back before the
  role starts (the role then sets its own, ``trainer.train_threads`` and so on). CUDA is never
  initialised in the launcher.
* **The process as ``subprocess`` would make it** (``role_process.start_role``): its own process
  group, ``PR_SET_PDEATHSIG = SIGKILL`` (and exit if the launcher is already gone), stdin from
  ``/dev/null``, stdout and stderr appended to the role's log, no other file descriptor inherited,
  Python's default signal dispositions, the launcher's ``atexit`` handlers dropped, ``sys.path[0]``
  the working directory, ``sys.argv`` the module's file and its arguments. The child is the
  launcher's own child, so it is observed, signalled and reaped like a spawned one.
* **Its exit status as the interpreter's**: ``SystemExit`` codes, 1 and a traceback for an uncaught
  exception, "No module named ..." and 1 for a module that is not there, death by SIGINT for an
  uncaught ``KeyboardInterrupt``.

Where a role's process shows its name: ``/proc/PID/comm`` (``ps -o comm``) is the role name, cut
to 15 bytes; its command line stays the launcher's.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

_PR_SET_NAME = 15


def pdeathsig_preexec() -> Callable[[], None] | None:
    """Run in a child right after fork: it receives SIGKILL when the launcher dies, and exits at once
    if the launcher is already gone (Linux only; None elsewhere). ``subprocess``'s ``preexec_fn``
    for a spawned role, called directly in a forked one."""
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl  # resolved before fork, not in the child
    pr_set_pdeathsig, parent = 1, os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl: do not run orphaned
            os._exit(1)

    return preexec


def fork_supported() -> bool:
    """Whether roles can be forked here: Linux (``os.fork`` and ``prctl``) with a libc to call."""
    return sys.platform.startswith("linux") and ctypes.util.find_library("c") is not None


@dataclass
class ForkedProcess:
    """The ``subprocess.Popen`` surface the launcher uses, for a child made by :func:`fork_role`."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (``-N``: killed by signal N) once the child has exited, reaping it; else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout`` seconds) for the child to exit and reap it.

        Raises:
            subprocess.TimeoutExpired: it is still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code


@dataclass(frozen=True)
class Forker:
    """What :func:`prepare` found: torch's default thread count, to give back to each child."""

    default_threads: int | None

    def usable(self) -> bool:
        """Whether forking is still safe: not once CUDA was initialised in this process (a forked
        child cannot use it); the caller starts a fresh interpreter instead."""
        torch = sys.modules.get("torch")
        return torch is None or not torch.cuda.is_initialized()


def prepare(modules: list[str]) -> Forker:
    """Import torch, ``torch._dynamo`` (which torch imports lazily, about 1 CPU-second, when a role
    builds its model on the meta device) and the role modules (``module`` and ``module.cli`` of
    each; one that fails to import is left to fail in its child, as ``python -m`` would), and pin the
    launcher's torch to one thread, so it never creates an OpenMP team (module docstring). Call
    before the launcher touches a tensor."""
    try:
        import torch
    except ImportError:
        return Forker(None)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # ~1 s: torch imports it lazily when a model is built on "meta"
    for module in modules:
        for name in (module, f"{module}.cli"):
            try:
                importlib.import_module(name)
            except Exception:  # the child reports it, as the interpreter would
                break
    return Forker(default_threads)


def fork_role(forker: Forker, module_args: list[str], log: Path, name: str,
              env: Mapping[str, str] | None = None) -> ForkedProcess:
    """Fork a child that runs ``python -m module_args...`` in-process (module docstring), its stdout
    and stderr appended to ``log``, with ``env`` set in its environment; the child never returns here."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # resolved before fork
    die_with_parent = pdeathsig_preexec()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        stream.flush()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid)
    code = 1
    try:
        _become_role(libc, die_with_parent, log, name, forker)
        os.environ.update(env or {})  # before the role imports anything that reads it (CUDA is not initialized)
        code = _run_module(module_args)
    except BaseException:  # the child must never run on as a launcher
        with contextlib.suppress(BaseException):
            os.write(2, traceback.format_exc().encode(errors="replace"))
    finally:
        os._exit(code)


def _become_role(libc: ctypes.CDLL, die_with_parent: Callable[[], None] | None, log: Path, name: str,
                 forker: Forker) -> None:
    """In the child: the process ``subprocess.Popen(process_group=0, ...)`` would have made."""
    os.setpgid(0, 0)
    if die_with_parent is not None:
        die_with_parent()
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    signal.set_wakeup_fd(-1)
    for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                         (signal.SIGHUP, signal.SIG_DFL), (signal.SIGPIPE, signal.SIG_IGN)):
        signal.signal(sig, handler)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, _max_fd())
    # Python's streams over the new descriptors, as a fresh interpreter opens them (the launcher's
    # may wrap other descriptors, closed now, and are buffered as its own output needed).
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    atexit._clear()  # the launcher's; the role registers its own
    sys.path[0] = os.getcwd()
    if forker.default_threads is not None:
        import torch

        torch.set_num_threads(forker.default_threads)


def _max_fd() -> int:
    try:
        return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


def _run_module(module_args: list[str]) -> int:
    """Run ``python -m module_args...`` in this process; its exit code as the interpreter's."""
    import runpy

    module, *args = module_args
    sys.argv = ["-m", *args]
    try:
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except ImportError as e:
            if getattr(e, "name", None) is None and "No module named" in str(e):  # runpy's own error
                print(f"{sys.executable}: {e}", file=sys.stderr)
                return 1
            raise
        code: int = 0
    except SystemExit as e:
        code = _exit_status(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # the interpreter's way: die by the signal
        return 130
    except BaseException:  # the interpreter's: a traceback and exit 1
        traceback.print_exc()
        code = 1
    _finish()
    return code


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """The interpreter's shutdown that matters to a role: its ``atexit`` handlers, flushed streams."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
