"""A role's process on a Ray node as the launcher sees it: :class:`RayProcess`, the Popen-like face
(``role_process.RemoteProcess``) of the process a :class:`~specroll.actors.launch.ray_host.RoleHost`
actor started, observed, signalled and reaped through that actor (``ray_cluster.py`` places it)."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specroll.protocol.placement_messages import RoleStarted

CALL_TIMEOUT_S = 30.0
"""How long one call to a role's actor may take before the launcher treats the answer as unknown
(the actor's node unreachable for now); Ray reports a node it declared dead as ``RayActorError``."""


@dataclass
class RayProcess:
    """A role's process on a Ray node, seen through its actor (``role_process.RemoteProcess``)."""

    name: str
    host: Any
    """The role's :class:`~specroll.actors.launch.ray_host.RoleHost` actor handle."""
    started: RoleStarted
    log_path: Path
    mirror_log: bool
    """The launcher's host does not see the log: copy its tail into ``log_path`` here at each exit."""
    returncode: int | None = None
    lost: str | None = None
    """Why the actor is gone (``RayActorError``), once it is."""

    @property
    def pid(self) -> int:
        return self.started.pid

    def call(self, method: str, *args: object, timeout: float = CALL_TIMEOUT_S) -> object:
        """``ray.get(host.method.remote(*args))``; raises ``RayActorError`` once the actor is gone
        and ``GetTimeoutError`` / ``ActorUnavailableError`` while it cannot answer."""
        import ray

        return ray.get(getattr(self.host, method).remote(*args), timeout=timeout)

    def poll(self) -> int | None:
        """The exit code once the process exited (not reaped), -SIGKILL once the actor is gone; else None."""
        import ray

        if self.returncode is not None:
            return self.returncode
        try:
            code = self.call("poll", self.pid)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            return None  # unknown for now; Ray declares an unreachable node dead within its health-check period
        except ray.exceptions.RayActorError as e:
            self.lost = (f"its Ray actor died ({type(e).__name__}: its worker process ended, or its node "
                         f"{self.started.node_ip} was lost)")
            code = -int(signal.SIGKILL)
        assert code is None or isinstance(code, int)
        if code is not None:
            self.returncode = code
            self._copy_tail()
        return code

    def killpg(self, sig: signal.Signals) -> None:
        """Signal the process group on its node (nothing once the actor is gone: its process died with it)."""
        import ray

        if self.lost is None:
            try:
                self.call("killpg", self.pid, int(sig))
            except ray.exceptions.RayError:
                pass  # gone or unreachable: poll() reports it

    def wait(self, timeout: float | None = None) -> int:
        """Reap the exited process on its node and return its exit code.

        Raises:
            subprocess.TimeoutExpired: it has not exited within ``timeout`` seconds.
        """
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.lost is not None:
                return -int(signal.SIGKILL)
            try:
                code = self.call("reap", self.pid, 1.0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                code = None  # unreachable for now (ActorUnavailableError is a RayActorError: caught first)
            except ray.exceptions.RayActorError:
                return self.returncode if self.returncode is not None else -int(signal.SIGKILL)
            if isinstance(code, int):
                self.returncode = code
                return code
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"{self.name} (pid {self.pid} on {self.started.node_ip})",
                                                timeout or 0.0)

    def _copy_tail(self) -> None:
        """At an exit seen here: an actor's death is a line of the role's log (its process died with
        it); where the launcher's host does not see that log, its tail is copied there (module docstring)."""
        import ray

        where = f"{self.started.hostname} ({self.started.node_ip})"
        if self.lost is not None:
            with self.log_path.open("a") as log:
                log.write(f"==== specroll launch: {self.name} (pid {self.pid} on {where}): {self.lost}\n")
        if not self.mirror_log or self.lost is not None:
            return
        try:
            text = str(self.call("tail", 40))
        except ray.exceptions.RayError as e:  # a report without the tail still goes on
            text = f"  (the log tail could not be fetched: {type(e).__name__})"
        with self.log_path.open("a") as log:
            log.write(f"==== specroll launch: {self.name} (pid {self.pid}) exited with {self.returncode}; the tail "
                      f"of its log on {where}, {self.log_path}:\n{text}\n")
