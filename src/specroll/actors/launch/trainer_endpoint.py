"""The trainer's endpoint as the launcher learns it: once bound, the trainer writes
``tcp://HOST:PORT`` (or ``ipc://PATH``) to ``RUN_DIR/trainer.endpoint``; the launcher waits for that
file, passes the endpoint to the generators and the drafter trainer, and pins a restarted trainer
to the port the first one took."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.ray_cluster import RayCluster
from specroll.actors.launch.role_process import RoleProcess, death_error, observe_exit, tail

ENDPOINT_FILENAME = "trainer.endpoint"
"""The trainer writes its bound endpoint (``tcp://HOST:PORT``) to ``RUN_DIR/trainer.endpoint``."""

_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def local_endpoint(endpoint: str) -> str:
    """The endpoint a local generator connects to: a wildcard bind address becomes 127.0.0.1.

    Raises:
        LaunchError: the text is not ``tcp://HOST:PORT`` or ``ipc://PATH``.
    """
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise LaunchError(f"{ENDPOINT_FILENAME} holds {endpoint!r}, expected tcp://HOST:PORT or ipc://PATH")
    return f"tcp://127.0.0.1:{port}" if host in _WILDCARD_HOSTS else endpoint


def wait_endpoint(trainer: RoleProcess, path: Path, timeout_s: float, poll_s: float,
                  check_signal: Callable[[], None], cluster: RayCluster | None) -> str:
    """The endpoint the trainer wrote to ``path``, once it is there.

    Raises:
        LaunchError: the trainer exited first, or wrote nothing within ``timeout_s``
            (``--startup-timeout-s``); or ``check_signal`` raised it (the launcher was signalled).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        check_signal()
        text = _read_endpoint(trainer, path, cluster)
        if text:
            return text
        code = observe_exit(trainer)
        if code is not None:
            raise death_error(trainer, code, "before writing its endpoint")
        if time.monotonic() > deadline:
            raise LaunchError(f"the trainer (pid {trainer.pid}) wrote no {path} within "
                              f"{timeout_s:g} s (--startup-timeout-s); "
                              f"last lines of {trainer.log_path}:",
                              detail=tail(trainer.log_path))
        time.sleep(poll_s)


def _read_endpoint(trainer: RoleProcess, path: Path, cluster: RayCluster | None) -> str:
    """What the trainer wrote to ``path`` so far (``""``: nothing yet); under Ray, read on the
    trainer's node with a wildcard host made that node's IP (``ray_cluster.py``)."""
    if cluster is not None:
        return cluster.endpoint(trainer, path)
    return path.read_text(errors="replace").strip() if path.exists() else ""


def port_pin(endpoint: str, trainer_port: int) -> list[str]:
    """The trainer's extra arguments so that a restarted trainer binds where the generators reconnect:
    the port the first one took (none when ``network.trainer_port`` already names one, or over ``ipc://``)."""
    if endpoint.startswith("tcp://") and not trainer_port:
        port = endpoint.rpartition(":")[2]
        return ["--set", f"network.trainer_port={port}"]
    return []
