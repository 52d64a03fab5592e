"""Storage faults made for real, in a child process: a full disk, and a SIGKILL at a chosen point of a
write. Nothing is timed and nothing of specroll is replaced: the operating system fails the writes.

* A full disk, two ways (:data:`DISK_FULL`): ``ENOSPC`` — the folder is a small tmpfs
  (:func:`tmpfs`, root with mount rights only) that the child fills to its last page
  (:func:`fill_disk`); ``EFBIG`` — the child lowers its own ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored
  (:func:`limit_file_size`), so a write past the limit fails; this one needs no rights, so it runs
  everywhere, CI included. Never lower the limit in the pytest process itself: its own output may
  be a file.
* A SIGKILL mid-write: the child stops itself (SIGSTOP) just before its N-th call of an ``os``
  function that moves a write on (:func:`stop_before_call`); the parent waits for the stop and
  kills it there (:func:`run_to_stop`). Stepping N through every call reproduces every state a
  SIGKILL between two of them can leave; what a kill inside a call leaves (a file cut short) is a
  state of the folder being written, which no reader looks at.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from helpers.timeouts import guard

DISK_FULL = {"ENOSPC": errno.ENOSPC, "EFBIG": errno.EFBIG}
"""The two ways :func:`full_disk_child` fills a disk, and the errno a write then fails with."""
FILE_SIZE_LIMIT = 4096
"""The ``EFBIG`` way's ``RLIMIT_FSIZE``, in bytes: small JSON files fit, tensors do not."""
MOVING_CALLS = ("mkdir", "open", "fsync", "fchmod", "chmod", "rename", "replace", "unlink", "rmdir")
"""The ``os`` functions :func:`stop_before_call` counts."""
TESTS_DIR = Path(__file__).resolve().parents[1]


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN), tried once on a scratch folder."""
    if os.geteuid() != 0:
        return False
    scratch = Path(f"/tmp/specroll-mount-probe-{os.getpid()}")
    scratch.mkdir(exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(scratch)],
                                 capture_output=True).returncode == 0
        if mounted:
            subprocess.run(["umount", str(scratch)], check=True)
        return mounted
    except OSError:  # no mount command
        return False
    finally:
        scratch.rmdir()


@contextlib.contextmanager
def tmpfs(folder: Path, size_bytes: int) -> Iterator[Path]:
    """``folder`` (made) as a tmpfs of ``size_bytes``; unmounted on the way out, also on failure."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def disk_folder(fault: str, folder: Path, size_bytes: int) -> contextlib.AbstractContextManager[Path]:
    """``folder``, made, where a child can make ``fault`` (a key of :data:`DISK_FULL`): for ENOSPC a
    tmpfs of ``size_bytes`` (unmounted on the way out), for EFBIG any folder."""
    if fault == "ENOSPC":
        return tmpfs(folder, size_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(folder)


def fill_disk(folder: Path) -> None:
    """Fill ``folder``'s file system to its last byte (``folder/.filler``): any write there then fails
    with ENOSPC. Call it in the child."""
    fd = os.open(folder / ".filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 1 << 12, 1):  # big writes first, then what is left a page and a byte at a time
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)


def limit_file_size(limit: int = FILE_SIZE_LIMIT) -> None:
    """From now on a write past ``limit`` bytes of any file fails with EFBIG (``SIGXFSZ`` ignored, so
    it does not kill the process). Call it in the child only."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def make_disk_full(fault: str, folder: Path) -> None:
    """In the child: ``fault`` (a key of :data:`DISK_FULL`) from now on, for writes into ``folder``."""
    if fault == "ENOSPC":
        fill_disk(folder)
    else:
        limit_file_size()


def stop_before_call(n: int, names: tuple[str, ...] = MOVING_CALLS) -> None:
    """In the child: stop this process (SIGSTOP) just before its ``n``-th call (1-based) of one of
    the ``os`` functions ``names``, counted from now."""
    calls = 0

    def hook(real):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == n:
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(*args, **kwargs)
        return call

    for name in names:
        setattr(os, name, hook(getattr(os, name)))


def child_command(code: str, *args: object) -> list[str]:
    """``python -c code args...``."""
    return [sys.executable, "-c", code, *map(str, args)]


def child_env() -> dict[str, str]:
    """The environment of a child that imports ``helpers`` (and specroll, as this process does)."""
    paths = [str(TESTS_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_child(code: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code args...`` to its end (hang guard ``timeout`` s); its output as text."""
    return subprocess.run(child_command(code, *args), env=child_env(), capture_output=True, text=True,
                          timeout=guard(timeout))


def run_to_stop(code: str, *args: object, timeout: float = 120) -> bool:
    """Run ``python -c code args...``: SIGKILL it where it stops itself and return True, or return
    False when it ran to its end (exit 0) without stopping (hang guard ``timeout`` s).

    Raises:
        AssertionError: it exited non-zero (its output in the message), or hung.
    """
    proc = subprocess.Popen(child_command(code, *args), env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + guard(timeout)
    try:
        while True:
            pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
            if pid:
                break
            assert time.monotonic() < deadline, f"child {proc.args} neither stopped nor ended (hang guard)"
            time.sleep(0.01)
        if os.WIFSTOPPED(status):
            os.kill(proc.pid, signal.SIGKILL)
            os.waitpid(proc.pid, 0)
            proc.returncode = -signal.SIGKILL
            return True
        proc.returncode = os.waitstatus_to_exitcode(status)
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{out[-3000:]}"
        return False
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            os.waitpid(proc.pid, 0)
            proc.returncode = -signal.SIGKILL
        if proc.stdout:
            proc.stdout.close()
