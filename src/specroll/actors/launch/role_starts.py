"""How the launcher starts a role's process, and the roles and processes of the run it started.

Process hygiene (the mechanics in ``role_process.py``): each role runs in its own process group
(``pgid == pid``) with stdout and stderr in ``RUN_DIR/logs/<role>.log``; ``RUN_DIR/pids.json`` is
true at every moment (:meth:`RoleStarts.write_pids`). A child that exits is observed without being
reaped (``waitid(WNOWAIT)``): its zombie keeps the pid — and with it the process-group id — reserved,
so a SIGKILL to that group can only reach processes the launcher started (and anything they left
behind in their group). A dead role's group is SIGKILLed at once (its leftovers serve nothing), and
its zombie is reaped as soon as the group is empty (``role_process.reap_if_alone``). On Linux each
child also gets ``PR_SET_PDEATHSIG = SIGKILL``, so even a SIGKILLed launcher leaves no role running.

How a role starts (``[launch] fork_roles``, default true on Linux; ``role_fork.py``): the launcher
imports torch and the role modules once, before its preflight touches a tensor, and each start or
restart of a role is a fork of the launcher running the role's ``__main__`` as ``python -m`` would —
the same process group, log, descriptors, signal handlers and exit statuses, without a fresh
interpreter's ~3 CPU-seconds of imports. With ``fork_roles = false`` (or off Linux) each role is a
fresh ``python -m`` interpreter.

Placement on Ray (``[cluster] backend = "ray"``, ``specroll launch --cluster ray``;
``ray_cluster.py``): each role's process is started on a Ray node by an actor reserving the role's
``[cluster.<role>]`` resources, and supervised through it exactly as on this host.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specroll.actors.launch.rank_roles import TRAINER_ROLE, free_master, rank_args, rank_role, with_master
from specroll.actors.launch.ray_cluster import RayCluster
from specroll.actors.launch.role_fork import Forker
from specroll.actors.launch.role_process import RoleProcess, reap_if_alone, start_role
from specroll.actors.shared.files import write_text_atomic

TRAINER_MODULE = "specroll.actors.trainer"
GENERATOR_MODULE = "specroll.actors.generator"
DRAFTER_MODULE = "specroll.actors.drafter_trainer"
PIDS_FILENAME = "pids.json"
"""In the run directory: ``{"launcher": PID, "processes": {"trainer": PID, "generator-0": PID, ...},
"exited": [{"role": NAME, "pid": PID, "exit_code": CODE}, ...]}`` — ``processes`` the role processes
not yet reaped (each pid, and its process group, still the launcher's), ``exited`` those reaped, in
order (history: their pids may belong to anyone by now); ``launcher`` is null once the launch ended."""
LOGS_DIRNAME = "logs"


@dataclass
class Role:
    """One supervised role: how to start it, its current process and its deaths."""

    name: str
    module_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Variables set in its environment (its GPUs: ``gpu_plan.py``)."""
    proc: RoleProcess | None = None
    """The running process; None while a restart is pending (or after the drafter trainer gave up)."""
    started_at: float = 0.0
    restart_at: float | None = None
    """When (``time.monotonic()``) its pending restart is due."""
    deaths: list[float] = field(default_factory=list)
    """Times of its counted deaths within ``launch.restart_window_s``."""
    restarts: int = 0


@dataclass
class RoleStarts:
    """Starts the roles of one run (module docstring) and keeps every role and process started.

    Args:
        run_dir: the run directory (``logs/``, ``pids.json``).
        say: where status lines go.
        check_signal: raises :class:`~specroll.actors.launch.errors.LaunchError` once the launcher
            was signalled; called before every start.
        forker: start roles by forking the launcher (``role_fork.py``); None: fresh interpreters.
        cluster: start each role on a Ray node through its actor (``ray_cluster.py``); None: on this host.
    """

    run_dir: Path
    say: Callable[[str], None]
    check_signal: Callable[[], None]
    forker: Forker | None = None
    cluster: RayCluster | None = None
    roles: dict[str, Role] = field(default_factory=dict, init=False)
    """Every supervised role by name, with its current process."""
    processes: list[RoleProcess] = field(default_factory=list, init=False)
    """Every process started, in start order (the trainer first), restarted ones included."""
    exited: list[dict[str, object]] = field(default_factory=list, init=False)
    """The processes reaped, in order: ``{"role", "pid", "exit_code"}`` (``pids.json``'s ``exited``)."""
    _pids_warned: bool = field(default=False, init=False, repr=False)

    def start(self, name: str, module_args: list[str], env: dict[str, str] | None = None) -> RoleProcess:
        """Start role ``name`` (``python -m module_args...``, ``env`` set in its environment) and
        supervise it from now on."""
        role = Role(name, module_args, env or {})
        self.roles[name] = role
        return self.spawn(role)

    def start_trainer(self, module_args: list[str], world: int) -> RoleProcess:
        """Start the trainer: one role, or its ``world`` ranks (``rank_roles.py``); returns rank 0's process."""
        if world == 1:
            return self.start(TRAINER_ROLE, module_args)
        master = free_master()
        for rank in range(world):
            self.start(rank_role(rank), [*module_args, *rank_args(rank, world, master)])
        proc = self.roles[TRAINER_ROLE].proc
        assert proc is not None
        return proc

    def respawn(self, role: Role, world: int) -> None:
        """Start ``role`` again after its back-off; the trainer's ``world`` ranks all together, on a
        fresh master port."""
        if role.name != TRAINER_ROLE or world == 1:
            self.spawn(role)
            return
        master = free_master()
        for rank in range(world):
            rank_role_ = self.roles[rank_role(rank)]
            rank_role_.module_args = with_master(rank_role_.module_args, master)
            self.spawn(rank_role_)

    def spawn(self, role: Role) -> RoleProcess:
        """Start ``role``'s process in its own process group, output appended to its log."""
        self.check_signal()
        log_path = self.run_dir / LOGS_DIRNAME / f"{role.name}.log"
        if self.cluster is not None:
            proc = self.cluster.start(role.name, role.module_args, log_path, self.check_signal)
        else:
            proc = start_role(role.name, role.module_args, log_path, self.forker, env=role.env)
        role.proc, role.started_at = proc, time.monotonic()
        self.processes.append(proc)
        self.write_pids()
        where = f" {self.cluster.describe(proc)}" if self.cluster is not None else "".join(
            f", {k}={v}" for k, v in role.env.items())
        self.say(f"started {role.name} (pid {proc.pid}{where}), log: {log_path}")
        return proc

    def reap_exited(self) -> None:
        """Reap each exited process whose group is empty (``role_process.reap_if_alone``); ``pids.json``
        rewritten when one was."""
        reaped = [p for p in self.processes if not p.reaped and reap_if_alone(p)]
        for p in reaped:
            self.exited.append({"role": p.name, "pid": p.pid, "exit_code": p.exit_code})
        if reaped:
            self.write_pids()

    def write_pids(self, launcher_running: bool = True) -> None:
        """Write ``RUN_DIR/pids.json`` (:data:`PIDS_FILENAME`) as things stand: called after every start,
        reap and death, and at the end of the launch (``launcher_running`` false). A write that fails
        (a full disk) is one warning line, not the launcher's end."""
        reaped = {int(str(e["pid"])) for e in self.exited}
        for p in self.processes:  # reaped elsewhere (teardown, the warm start): history now
            if p.reaped and p.pid not in reaped:
                self.exited.append({"role": p.name, "pid": p.pid, "exit_code": p.exit_code})
        current: dict[str, int] = {}
        for p in reversed(self.processes):  # the latest process of a role under its name, an earlier one
            if not p.reaped:                # still unreaped (its group not yet empty) beside it
                current[p.name if p.name not in current else f"{p.name}@{p.pid}"] = p.pid
        pids = {"launcher": os.getpid() if launcher_running else None, "processes": current, "exited": self.exited}
        try:
            write_text_atomic(self.run_dir / PIDS_FILENAME, json.dumps(pids, indent=1) + "\n")
        except OSError as e:  # a full disk: the old file stays (atomic); supervision must go on
            if not self._pids_warned:
                self.say(f"warning: cannot write {self.run_dir / PIDS_FILENAME} ({e.strerror or e}); it may list "
                         "processes that ended until it can be written again")
            self._pids_warned = True
        else:
            self._pids_warned = False
