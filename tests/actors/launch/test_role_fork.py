"""``role_fork.py``: a role forked from the launcher runs as ``python -m`` would run it — its own
process group, stdin from /dev/null, stdout and stderr in its log, no inherited descriptor, default
signal handlers, none of the launcher's ``atexit`` handlers, the interpreter's exit statuses — and a
launcher that ran torch ops before forking (the preflight loads a drafter) does not hang its child.

The children run small modules written to ``tmp_path`` (the working directory, which a forked role
puts first on ``sys.path`` as ``python -m`` does); none touches torch except in the OpenMP test, which
forks from a fresh interpreter: this pytest process has run OpenMP regions of its own."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specroll.actors.launch.role_fork import ForkedProcess, Forker, fork_supported
from specroll.actors.launch.role_process import observe_exit, start_role

pytestmark = [pytest.mark.skipif(not fork_supported(), reason="forking roles needs Linux"), pytest.mark.integration]

WAIT_S = 120  # a hang guard only: every child here ends within a second on an idle machine


def run_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, *args: str) -> tuple[int, str, int]:
    """Write ``source`` as module ``sample_role``, fork it with ``args``; (exit code, log, pid)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sample_role.py").write_text(textwrap.dedent(source))
    log = tmp_path / "role.log"
    proc = start_role("role-under-test", ["sample_role", *args], log, Forker(None))
    assert isinstance(proc.popen, ForkedProcess)
    code = proc.popen.wait(timeout=WAIT_S)
    return code, log.read_text(), proc.pid


def test_a_forked_role_is_set_up_as_a_fresh_interpreter_would_be(tmp_path: Path, monkeypatch) -> None:
    leaked = open(tmp_path / "launcher-file", "w")  # a descriptor the child must not get
    marker, parent = tmp_path / "launcher-atexit-ran", os.getpid()

    def handler() -> None:
        if os.getpid() != parent:
            marker.write_text("yes")

    atexit.register(handler)
    try:
        code, log, pid = run_role(tmp_path, monkeypatch, """
            import json, os, signal, sys
            print("hello from the role")
            print("to stderr", file=sys.stderr)
            state = {
                "argv": sys.argv[1:], "argv0": sys.argv[0], "name": __name__,
                "pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(),
                "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
                "stdin": sys.stdin.read(),
                "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                "comm": open("/proc/self/comm").read().strip(),
                "path0": sys.path[0],
            }
            with open("state.json", "w") as f:
                json.dump(state, f)
            sys.exit(7)
        """, "--flag", "value")
    finally:
        atexit.unregister(handler)
        leaked.close()
    state = json.loads((tmp_path / "state.json").read_text())
    assert code == 7
    assert state["argv"] == ["--flag", "value"] and state["argv0"].endswith("sample_role.py")
    assert state["name"] == "__main__" and state["pid"] == pid
    assert state["pgid"] == pid and state["ppid"] == os.getpid()  # its own group, the launcher's child
    assert state["fds"] == [0, 1, 2, 3]  # 3: the listing's own descriptor
    assert state["stdin"] == "" and state["sigint"] and state["sigterm"]
    assert state["comm"] == "role-under-test"[:15] and state["path0"] == str(tmp_path)
    assert "hello from the role" in log and "to stderr" in log
    assert not marker.exists(), "the launcher's atexit handler ran in the role"


@pytest.mark.parametrize(("source", "code", "in_log"), [
    ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
    ("import sys; sys.exit('a message')", 1, "a message"),
    ("import sys; sys.exit()", 0, ""),
    ("import atexit; atexit.register(lambda: print('role atexit ran'))", 0, "role atexit ran"),
    ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
])
def test_exit_status_as_the_interpreter_reports_it(tmp_path: Path, monkeypatch, source: str, code: int,
                                                    in_log: str) -> None:
    got, log, _ = run_role(tmp_path, monkeypatch, source)
    assert got == code, log
    assert in_log in log


def test_a_missing_module_exits_1_naming_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "role.log"
    proc = start_role("missing", ["no_such_role_module_xyz"], log, Forker(None))
    assert proc.popen.wait(timeout=WAIT_S) == 1
    assert "No module named no_such_role_module_xyz" in log.read_text()


def test_a_forked_role_is_observed_without_being_reaped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sample_role.py").write_text("import sys; sys.exit(3)\n")
    proc = start_role("r", ["sample_role"], tmp_path / "role.log", Forker(None))
    assert isinstance(proc.popen, ForkedProcess)
    deadline = time.monotonic() + WAIT_S
    while observe_exit(proc) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proc.exit_code == 3 and not proc.reaped
    assert os.path.exists(f"/proc/{proc.pid}")  # the zombie keeps the pid (and the group id) reserved
    assert proc.popen.wait(timeout=WAIT_S) == 3
    assert not os.path.exists(f"/proc/{proc.pid}")


DRIVER = """
import json, sys, time
import torch
from specroll.actors.launch.role_fork import prepare, fork_role
forker = prepare([])
x = torch.randn(1500, 1500)
for _ in range(3):
    (x @ x).sum(); torch.exp(torch.randn(4_000_000)).sum()  # would create an OpenMP team, unpinned
child = fork_role(forker, ["omp_role"], __import__("pathlib").Path("omp.log"), "omp")
print(json.dumps({"code": child.wait(timeout=float(sys.argv[1])), "launcher_threads": torch.get_num_threads()}))
"""

OMP_ROLE = """
import json, torch
x = torch.randn(1500, 1500)
for _ in range(3):
    (x @ x).sum(); torch.exp(torch.randn(4_000_000)).sum()
json.dump({"threads": torch.get_num_threads()}, open("omp.json", "w"))
"""


def test_torch_ops_in_the_launcher_do_not_hang_a_forked_role(tmp_path: Path) -> None:
    """GNU OpenMP hangs a child forked after its parent ran a parallel region; ``prepare`` pins the
    launcher's torch to one thread so none ever runs, and gives the child torch's default back."""
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "omp_role.py").write_text(OMP_ROLE)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "driver.py", str(WAIT_S)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=WAIT_S + 60)
    assert out.returncode == 0, out.stderr + (tmp_path / "omp.log").read_text()
    result = json.loads(out.stdout)
    assert result == {"code": 0, "launcher_threads": 1}
    assert json.loads((tmp_path / "omp.json").read_text()) == {"threads": 2}
