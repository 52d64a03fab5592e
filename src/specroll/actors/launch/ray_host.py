"""A role's host on a Ray node: the actor ``specroll launch --cluster ray`` places with the role's
resources (``[cluster.<role>]``), which starts the role's process on its node and observes, signals
and reaps it when the launcher asks (``ray_cluster.py`` is the launcher's side).

The role runs as the actor's child process — a fresh ``python -m specroll.actors.<role>``
interpreter made by :func:`~specroll.actors.launch.role_process.start_role`, exactly as the local
launcher makes it — not inside the actor, because:

* the role keeps its own process: its signal handlers and exit codes (0/1/2/3, what supervision
  reads), its anyio loop and torch threads, away from the Ray worker's own threads and gRPC;
* a crash of the role (a segfault, ``os._exit``) is an exit code the launcher reads here, not a dead
  actor that looks like a lost node;
* it runs in its own process group (``pgid == pid``), so stopping it reaches whatever it started;
  ``PR_SET_PDEATHSIG`` kills it when the actor's worker dies (``ray.kill``, a crash): no role outlives
  its actor;
* restarting the role reuses the actor (its node, its reserved resources) and costs one process start.

Ray runs a non-async actor's methods one at a time on the worker's main thread — which matters:
``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits. Every method returns at once;
the launcher polls.

The child inherits the worker's environment, ``CUDA_VISIBLE_DEVICES`` (the GPUs Ray reserved for
the actor) included, and Python (``sys.executable``: the node's Ray worker interpreter, which must
have specroll installed) — but not its signal state: a Ray worker blocks SIGINT and ignores SIGQUIT,
which ``exec`` would pass on, so the child starts with every signal unblocked and at its default
(``start_role(default_signals=True)``), as under the local launcher.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import msgspec
import ray

from specroll.actors.launch.role_process import RoleProcess, killpg, observe_exit, start_role, tail
from specroll.protocol.curve import all_files
from specroll.protocol.placement_messages import RoleSpec, RoleStarted

_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


class RoleHost:
    """Starts one role's process on this node and answers the launcher's questions about it.

    Ray makes it an actor (``ray.remote(RoleHost).options(num_cpus=..., num_gpus=...)``); every
    method returns at once (module docstring). Methods name the process by its pid: a restart makes
    a new one, and a question about an earlier one (reaped at the restart) gets its recorded exit.
    """

    def __init__(self) -> None:
        self.keys_dir: Path | None = None
        """The private folder this role's key files were written to (CURVE), if any."""
        self.proc: RoleProcess | None = None
        self.exits: dict[int, int | None] = {}
        """Exit codes of this role's earlier processes (reaped), by pid."""

    def start(self, spec_bytes: bytes) -> bytes:
        """Start the role ``spec_bytes`` describes (a msgpack :class:`RoleSpec`); a process of an
        earlier start must have exited, and is reaped first (with a SIGKILL to its group, for
        anything it left there).

        Returns:
            a msgpack :class:`RoleStarted`.

        Raises:
            msgspec.ValidationError: ``spec_bytes`` is not a valid :class:`RoleSpec`.
            RuntimeError: the previous process of this role is still running.
        """
        spec = msgspec.msgpack.decode(spec_bytes, type=RoleSpec)
        if self.proc is not None:
            if observe_exit(self.proc) is None:
                raise RuntimeError(f"role {spec.name!r} is still running (pid {self.proc.pid}), expected it exited")
            self.stop()
            self.exits[self.proc.pid] = self.proc.exit_code
        cwd, config, log = Path(spec.cwd), Path(spec.config_path), Path(spec.log_path)
        cwd.mkdir(parents=True, exist_ok=True)
        for stale in spec.stale_files:
            Path(stale).unlink(missing_ok=True)
        if not config.exists() or config.read_text(errors="replace") != spec.config_text:
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(spec.config_text)  # this node does not share the launcher's filesystem
        log.parent.mkdir(parents=True, exist_ok=True)
        args = list(spec.module_args)
        if spec.key_files:
            args += ["--keys", str(self._write_keys(spec.key_files))]
        self.proc = start_role(spec.name, args, log, cwd=cwd, default_signals=True)
        return msgspec.msgpack.encode(RoleStarted(pid=self.proc.pid, node_id=ray.get_runtime_context().get_node_id(),
                                                  node_ip=ray.util.get_node_ip_address(),
                                                  hostname=socket.gethostname()))

    def _write_keys(self, files: dict[str, bytes]) -> Path:
        """Write the role's key files into this host's private folder (made once: ``mkdtemp`` is
        0700; each file created 0600, never readable by others even for a moment).

        Raises:
            ValueError: a file name that is not one of the run's key files.
        """
        for name in files:
            if name not in all_files():
                raise ValueError(f"key file {name!r}, expected one of {all_files()}")
        if self.keys_dir is None:
            self.keys_dir = Path(tempfile.mkdtemp(prefix="specroll-keys-"))
        for name, data in files.items():
            fd = os.open(self.keys_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return self.keys_dir

    def _current(self, pid: int) -> RoleProcess | None:
        """The running (or exited, unreaped) process ``pid``; None for an earlier, reaped one.

        Raises:
            ValueError: ``pid`` was never started here.
        """
        if self.proc is not None and self.proc.pid == pid:
            return self.proc
        if pid in self.exits:
            return None
        raise ValueError(f"pid {pid}, expected one of the processes this host started ({sorted(self.exits)})")

    def poll(self, pid: int) -> int | None:
        """Process ``pid``'s exit code once it exited (``-N``: killed by signal N), without reaping it
        (its pid and process-group id stay reserved); None while it runs."""
        proc = self._current(pid)
        return self.exits[pid] if proc is None else observe_exit(proc)

    def killpg(self, pid: int, signum: int) -> None:
        """Send signal ``signum`` to the process group process ``pid`` leads (nothing once it was reaped)."""
        proc = self._current(pid)
        if proc is not None:
            killpg(proc, signal.Signals(signum))

    def reap(self, pid: int, timeout: float = 0.0) -> int | None:
        """Reap process ``pid`` and return its exit code; None if it has not exited within ``timeout``
        seconds (it then stays unreaped)."""
        proc = self._current(pid)
        if proc is None:
            return self.exits[pid]
        if not proc.reaped:
            try:
                proc.exit_code = proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
            proc.reaped = True
        return proc.exit_code

    def stop(self) -> None:
        """SIGKILL the current process's group and reap it: before a restart, and the last call before
        the actor is killed."""
        if self.proc is not None and not self.proc.reaped:
            killpg(self.proc, signal.SIGKILL)
            self.reap(self.proc.pid, timeout=30.0)

    def forget_keys(self) -> None:
        """Remove the role's key folder (the last call before the actor is killed)."""
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
            self.keys_dir = None

    def endpoint(self, path: str) -> str:
        """The endpoint the trainer wrote to ``path`` (``RUN_DIR/trainer.endpoint`` on this node), as
        peers on other nodes reach it: a wildcard host becomes this node's IP; ``""`` until written.

        Raises:
            ValueError: the file holds something other than ``tcp://HOST:PORT`` or ``ipc://PATH``.
        """
        try:
            text = Path(path).read_text(errors="replace").strip()
        except FileNotFoundError:
            return ""
        if not text or text.startswith("ipc://"):
            return text
        host, sep, port = text.removeprefix("tcp://").rpartition(":")
        if not text.startswith("tcp://") or not sep or not host or not port.isdigit():
            raise ValueError(f"{path} holds {text!r}, expected tcp://HOST:PORT or ipc://PATH")
        if host not in _WILDCARD_HOSTS:
            return text
        ip = ray.util.get_node_ip_address()
        return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the role's log on this node, each indented by two spaces."""
        return "" if self.proc is None else tail(self.proc.log_path, lines)
