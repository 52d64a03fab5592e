"""``specroll launch``: start a whole run on this host — one trainer and N generators as separate
processes — watch them, and tear everything down when the run ends, fails or is interrupted.

Lifecycle:

1. The config is loaded and validated (a ``ConfigError`` is one line, exit 2, nothing started), the
   model, prompts, port and checkpoint are checked and the run directory is locked
   (``preflight.py``), and the config is written resolved to ``RUN_DIR/config.toml``; every
   role reads that file.
2. The trainer starts (``python -m specroll.actors.trainer --config RUN_DIR/config.toml``) after a
   stale ``RUN_DIR/trainer.endpoint`` is removed; once bound it writes its endpoint there, which the
   launcher waits for (``startup_timeout_s``; the trainer dying first ends the launch). With
   ``trainer.world_size = N`` > 1 the trainer is N processes started together (``rank_roles.py``):
   rank 0 is the role ``trainer`` (the endpoint, the generators), rank r the role ``trainer-rank<r>``,
   each with ``--rank r --world-size N --master 127.0.0.1:PORT``, a fresh free PORT at every start.
3. ``generator.count`` generators start (``python -m specroll.actors.generator --config ...
   --connect ENDPOINT --actor-id generator-<i>``).
4. Supervise (``[launch]``, :class:`~specroll.actors.config.launch_section.LaunchConfig`): the trainer
   exiting 0 is the end of the run. A role that dies otherwise is started again after an
   exponential back-off — a generator (its groups resume on the others meanwhile, and on it once it
   rejoins under its old id), the drafter trainer (it warm-starts from ``RUN_DIR/drafter``), the
   trainer (from its last checkpoint, bound to the port the first one took, while the generators
   keep running and re-handshake). The trainer's ranks are one unit: any rank dying stops the
   others (SIGTERM, ``grace_s``, SIGKILL) and all restart together, counted as one death of
   ``trainer``; a rank other than 0 exiting 0 (it read rank 0's ``Stop``) is no death. Every
   restart is a line here and a count in ``RUN_DIR/restarts.json``, which the trainer copies into
   its metrics lines. A generator or drafter trainer that exits 0 or 3 while the trainer is away is
   restarted without counting. More than
   ``launch.max_restarts`` deaths of one role within ``launch.restart_window_s``, a role refused its
   configuration (exit 2), or SIGINT/SIGTERM to the launcher end the run with a failure report
   naming the role and the tail of its log (the drafter trainer's end only stops drafter training).
5. Teardown (always, in a ``finally``): SIGTERM to each live process group, ``grace_s`` to exit,
   then SIGKILL to every process group the launcher started, then reap. Once anything was started,
   the last line names the command that draws the run (``specroll report RUN_DIR``).

Process hygiene (the mechanics in ``role_process.py``): each role runs in its own process group
(``pgid == pid``) with stdout and stderr in ``RUN_DIR/logs/<role>.log``; ``RUN_DIR/pids.json`` lists
the launcher and every started pid. A child that exits is observed without being reaped
(``waitid(WNOWAIT)``): its zombie keeps the pid — and with it the process-group id — reserved, so
the final SIGKILL to that group can only reach processes the launcher started (and anything they
left behind in their group). On Linux each child also gets ``PR_SET_PDEATHSIG = SIGKILL``, so even
a SIGKILLed launcher leaves no role running.

How a role starts (``[launch] fork_roles``, default true on Linux; ``role_fork.py``): the launcher
imports torch and the role modules once, before its preflight touches a tensor, and each start or
restart of a role is a fork of the launcher running the role's ``__main__`` as ``python -m`` would —
the same process group, log, descriptors, signal handlers and exit statuses, without a fresh
interpreter's ~3 CPU-seconds of imports. With ``fork_roles = false`` (or off Linux) each role is a
fresh ``python -m`` interpreter.

Placement on Ray (``[cluster] backend = "ray"``, ``specroll launch --cluster ray``;
``ray_cluster.py``): each role's process is started on a Ray node by an actor reserving the role's
``[cluster.<role>]`` resources, and supervised through it exactly as above; the trainer's endpoint
is read on its node, and the Ray instance is left (or stopped, when the launch started it) at teardown.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.gpu_plan import gpu_env
from specroll.actors.launch.metrics_tail import MetricsTail, format_metrics, record_warnings
from specroll.actors.launch.rank_roles import (
    TRAINER_ROLE,
    free_master,
    is_trainer_rank,
    rank_args,
    rank_role,
    with_master,
)
from specroll.actors.launch.ray_cluster import RayCluster
from specroll.actors.launch.role_fork import Forker
from specroll.actors.launch.role_process import (
    RoleProcess,
    describe_exit,
    killpg,
    observe_exit,
    start_role,
    tail,
    terminate,
)
from specroll.actors.shared.exit_codes import EXIT_OK, EXIT_PEER_LOST, EXIT_REFUSED
from specroll.actors.shared.files import write_text_atomic
from specroll.actors.shared.restarts import write_restarts

if TYPE_CHECKING:
    from specroll.actors.config import RunConfig

__all__ = [
    "ENDPOINT_FILENAME",
    "PIDS_FILENAME",
    "TRAINER_MODULE",
    "Launcher",
]

TRAINER_MODULE = "specroll.actors.trainer"
GENERATOR_MODULE = "specroll.actors.generator"
DRAFTER_MODULE = "specroll.actors.drafter_trainer"
DRAFTER_ROLE = "drafter"
"""The drafter trainer's role name: not essential, so its death is reported and the run goes on."""
ENDPOINT_FILENAME = "trainer.endpoint"
"""The trainer writes its bound endpoint (``tcp://HOST:PORT``) to ``RUN_DIR/trainer.endpoint``."""
PIDS_FILENAME = "pids.json"
"""``{"launcher": PID, "processes": {"trainer": PID, "generator-0": PID, ...}}`` in the run directory."""
LOGS_DIRNAME = "logs"
METRICS_FILENAME = "metrics.jsonl"

_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def _specroll_command() -> str:
    """How this ``specroll`` was invoked (``.venv/bin/specroll`` after ``make run``, which is not on
    PATH), so the printed command can be pasted as is; plain ``specroll`` when run as a module."""
    invoked = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return str(invoked) if invoked is not None and invoked.name == "specroll" else "specroll"


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


@dataclass
class _Role:
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
class Launcher:
    """Starts, watches and stops the processes of one run (see the module docstring).

    Args:
        config: the validated run config.
        trainer_module: module run as the trainer (``python -m MODULE --config FILE``); tests pass
            a stand-in.
        startup_timeout_s: how long the trainer may take to write its endpoint.
        grace_s: how long processes get to exit after SIGTERM before their groups are SIGKILLed.
        poll_s: the watch loop's period.
        out: where status lines go; metrics lines go to ``metrics_out``.
        forker: start roles by forking this process (``[launch] fork_roles``, ``role_fork.py``);
            None: each role is a fresh interpreter.
        cluster: start each role on a Ray node through its actor (``[cluster] backend = "ray"``,
            ``ray_cluster.py``); None: on this host.
    """

    config: RunConfig
    trainer_module: str = TRAINER_MODULE
    startup_timeout_s: float = 300.0
    grace_s: float = 15.0
    poll_s: float = 0.1
    out: IO[str] = field(default_factory=lambda: sys.stderr)
    metrics_out: IO[str] = field(default_factory=lambda: sys.stdout)
    forker: Forker | None = None
    cluster: RayCluster | None = None
    processes: list[RoleProcess] = field(default_factory=list, init=False)
    """Every process started, in start order (the trainer first), restarted ones included."""
    roles: dict[str, _Role] = field(default_factory=dict, init=False)
    """Every supervised role by name, with its current process."""
    restarts: dict[str, int] = field(default_factory=dict, init=False)
    """Restarts so far by role (also in ``RUN_DIR/restarts.json`` and the metrics lines)."""
    _signal: int | None = field(default=None, init=False, repr=False)
    _hurry: bool = field(default=False, init=False, repr=False)
    metrics_tail: MetricsTail = field(init=False, repr=False)
    """Follows ``RUN_DIR/metrics.jsonl`` for the progress lines."""

    def __post_init__(self) -> None:
        self.metrics_tail = MetricsTail(self.run_dir / METRICS_FILENAME)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    def say(self, text: str) -> None:
        print(f"specroll launch: {text}", file=self.out, flush=True)

    # ---- the whole run --------------------------------------------------------------------------

    def run(self) -> int:
        """Start every role, watch them until the run ends, stop them all; return the exit code
        (0: the trainer finished; 1: a process died or the trainer never came up; 130/143: SIGINT/SIGTERM)."""
        from specroll.actors.config import write_resolved

        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                config_path = write_resolved(self.config)
                (self.run_dir / LOGS_DIRNAME).mkdir(exist_ok=True)
            except OSError as e:
                raise LaunchError(f"run_dir={self.config.run_dir!r}: cannot write the run directory "
                                  f"({e.strerror or e}), expected a writable directory", code=EXIT_REFUSED) from e
            self.metrics_tail.skip_existing()  # an earlier launch's lines: not this launch's progress
            endpoint_file = self.run_dir / ENDPOINT_FILENAME
            endpoint_file.unlink(missing_ok=True)  # stale, from an earlier run
            trainer = self._start_trainer([self.trainer_module, "--config", str(config_path)])
            endpoint = local_endpoint(self._wait_endpoint(trainer, endpoint_file))
            self.say(f"trainer listening at {endpoint}")
            self._fix_trainer_port(endpoint)
            gpus = gpu_env(self.config, DRAFTER_ROLE) if self.cluster is None else {}  # Ray assigns its own
            for i in range(self.config.generator.count):
                name = f"generator-{i}"
                self._start_role(name, [GENERATOR_MODULE, "--config", str(config_path), "--connect",
                                        endpoint, "--actor-id", name], gpus.get(name))
            if self.config.runs_drafter_trainer():
                self._start_role(DRAFTER_ROLE, [DRAFTER_MODULE, "--config", str(config_path), "--connect", endpoint,
                                                "--actor-id", "drafter-0"], gpus.get(DRAFTER_ROLE))
            if self.config.launch.max_restarts and not self.config.trainer.checkpoint_every:
                self.say("note: trainer.checkpoint_every = 0, so a restarted trainer starts over from step 0")
            return self._watch()
        except LaunchError as e:
            self.say(f"error: {e}")
            if e.detail:
                print(e.detail, file=self.out, flush=True)
            return e.code
        finally:
            try:
                self._teardown()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
                if (self.run_dir / METRICS_FILENAME).exists():  # a step (or the evaluation before one) to draw
                    self.say(f"report: {shlex.quote(_specroll_command())} report {shlex.quote(str(self.run_dir))}")

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._signal is not None:
            self._hurry = True  # a second Ctrl-C: skip the grace period
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            raise LaunchError(f"interrupted by {name}; stopping every process", code=128 + self._signal)

    # ---- starting -------------------------------------------------------------------------------

    def _start_role(self, name: str, module_args: list[str], env: dict[str, str] | None = None) -> RoleProcess:
        """Start role ``name`` (``python -m module_args...``, ``env`` set in its environment) and
        supervise it from now on."""
        role = _Role(name, module_args, env or {})
        self.roles[name] = role
        return self._spawn(role)

    def _start_trainer(self, module_args: list[str]) -> RoleProcess:
        """Start the trainer: one role, or its ``trainer.world_size`` ranks (``rank_roles.py``);
        returns rank 0's process."""
        world = self.config.trainer.world_size
        if world == 1:
            return self._start_role(TRAINER_ROLE, module_args)
        master = free_master()
        for rank in range(world):
            self._start_role(rank_role(rank), [*module_args, *rank_args(rank, world, master)])
        proc = self.roles[TRAINER_ROLE].proc
        assert proc is not None
        return proc

    def _respawn(self, role: _Role) -> None:
        """Start ``role`` again after its back-off; the trainer's ranks all together, on a fresh master port."""
        world = self.config.trainer.world_size
        if role.name != TRAINER_ROLE or world == 1:
            self._spawn(role)
            return
        master = free_master()
        for rank in range(world):
            rank_role_ = self.roles[rank_role(rank)]
            rank_role_.module_args = with_master(rank_role_.module_args, master)
            self._spawn(rank_role_)

    def _stop_trainer_ranks(self) -> None:
        """One rank died: stop the others (SIGTERM, ``grace_s`` to exit — rank 0 says ``Dead`` to the
        generators — then SIGKILL), so the whole unit restarts from the checkpoint together."""
        ranks = [r for r in self.roles.values() if is_trainer_rank(r.name) and r.proc is not None]
        for r in ranks:  # gone as well (rank 0 fails on its own when a peer dies): said, not counted
            if r.proc is not None and (code := observe_exit(r.proc)) is not None:
                self.say(f"{r.proc.name} (pid {r.proc.pid}) {describe_exit(code)} too")
        live = [r.proc for r in ranks if r.proc is not None and observe_exit(r.proc) is None]
        if live:
            self.say(f"stopping the other trainer ranks: {', '.join(p.name for p in live)}")
        for p in terminate(live, self.grace_s, self.poll_s, lambda: self._signal is not None):
            killpg(p, signal.SIGKILL)
        for r in ranks:
            r.proc = None

    def _spawn(self, role: _Role) -> RoleProcess:
        """Start ``role``'s process in its own process group, output appended to its log."""
        self._check_signal()
        log_path = self.run_dir / LOGS_DIRNAME / f"{role.name}.log"
        if self.cluster is not None:
            proc = self.cluster.start(role.name, role.module_args, log_path, self._check_signal)
        else:
            proc = start_role(role.name, role.module_args, log_path, self.forker, env=role.env)
        role.proc, role.started_at = proc, time.monotonic()
        self.processes.append(proc)
        current = {r.name: r.proc.pid for r in self.roles.values() if r.proc is not None}
        pids = {"launcher": os.getpid(), "processes": current}
        write_text_atomic(self.run_dir / PIDS_FILENAME, json.dumps(pids, indent=1) + "\n")
        where = f" {self.cluster.describe(proc)}" if self.cluster is not None else "".join(
            f", {k}={v}" for k, v in role.env.items())
        self.say(f"started {role.name} (pid {proc.pid}{where}), log: {log_path}")
        return proc

    def _fix_trainer_port(self, endpoint: str) -> None:
        """A restarted trainer must bind where the generators reconnect: the port the first one took."""
        if endpoint.startswith("tcp://") and not self.config.network.trainer_port:
            port = endpoint.rpartition(":")[2]
            self.roles["trainer"].module_args += ["--set", f"network.trainer_port={port}"]

    def _wait_endpoint(self, trainer: RoleProcess, path: Path) -> str:
        """The endpoint the trainer wrote to ``path``, once it is there."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            self._check_signal()
            text = self._read_endpoint(trainer, path)
            if text:
                return text
            code = observe_exit(trainer)
            if code is not None:
                raise self._died(trainer, code, "before writing its endpoint")
            if time.monotonic() > deadline:
                raise LaunchError(f"the trainer (pid {trainer.pid}) wrote no {path} within "
                                  f"{self.startup_timeout_s:g} s (--startup-timeout-s); "
                                  f"last lines of {trainer.log_path}:",
                                  detail=tail(trainer.log_path))
            time.sleep(self.poll_s)

    def _read_endpoint(self, trainer: RoleProcess, path: Path) -> str:
        """What the trainer wrote to ``path`` so far (``""``: nothing yet); under Ray, read on the
        trainer's node with a wildcard host made that node's IP (``ray_cluster.py``)."""
        if self.cluster is not None:
            return self.cluster.endpoint(trainer, path)
        return path.read_text(errors="replace").strip() if path.exists() else ""

    # ---- watching -------------------------------------------------------------------------------

    def _watch(self) -> int:
        """Supervise every role until the trainer exits 0 (return 0) or the run fails (raise LaunchError)."""
        while True:
            self._check_signal()
            self._print_metrics()
            trainer = self.roles["trainer"]
            # First: generators may notice the trainer's end on their own and exit.
            code = observe_exit(trainer.proc) if trainer.proc is not None else None
            if code == 0:
                self._print_metrics()
                steps = self.config.steps
                self.say(f"the trainer finished {steps} step{'s' if steps != 1 else ''}; stopping the generators")
                return EXIT_OK
            for role in self.roles.values():
                code = observe_exit(role.proc) if role.proc is not None else None
                if code is not None:
                    self._on_death(role, code)
            now = time.monotonic()
            for role in self.roles.values():
                if role.restart_at is not None and now >= role.restart_at:
                    role.restart_at = None
                    self._respawn(role)
            time.sleep(self.poll_s)

    def _on_death(self, role: _Role, code: int) -> None:
        """A role's process exited during the run: schedule its restart, or end the run (raise)."""
        proc = role.proc
        assert proc is not None
        role.proc = None
        ranked = self.config.trainer.world_size > 1 and is_trainer_rank(role.name)
        if ranked and role.name != TRAINER_ROLE and code == EXIT_OK:
            return  # it read rank 0's Stop: rank 0's own exit says how the trainer ended
        drafter = role.name == DRAFTER_ROLE
        limits = self.config.launch
        if code == EXIT_REFUSED or (limits.max_restarts == 0 and not drafter):
            if drafter:
                self.say(f"warning: the drafter trainer (pid {proc.pid}) {describe_exit(code)}; generation "
                         f"and training go on with the last drafter version (see {proc.log_path})")
                return
            raise self._died(proc, code)
        if ranked:  # the ranks are one unit: the others are stopped, one death counted, all restarted
            self._stop_trainer_ranks()
            role = self.roles[TRAINER_ROLE]
        now = time.monotonic()
        counted = not self._victim_of_trainer(role, code, now)
        if counted:
            role.deaths = [t for t in role.deaths if now - t <= limits.restart_window_s] + [now]
        if len(role.deaths) > limits.max_restarts:
            deaths = (f"{len(role.deaths)} deaths within {limits.restart_window_s:g} s, more than "
                      f"launch.max_restarts = {limits.max_restarts}")
            if drafter:
                self.say(f"warning: the drafter trainer (pid {proc.pid}) {describe_exit(code)} ({deaths}): not "
                         f"restarted again; generation and training go on with the last drafter version "
                         f"(see {proc.log_path})")
                return
            raise LaunchError(f"{proc.name} (pid {proc.pid}) {describe_exit(code)} ({deaths}); stopping the run. "
                              f"Last lines of {proc.log_path}:", detail=tail(proc.log_path))
        delay = limits.backoff_s(len(role.deaths)) if counted else 0.0
        role.restart_at = now + delay
        role.restarts += 1
        self.restarts[role.name] = role.restarts
        write_restarts(self.run_dir, self.restarts)
        why = "" if counted else " while the trainer was away (not counted)"
        what = "and rejoins"
        if role.name == TRAINER_ROLE:
            world = self.config.trainer.world_size
            what = "from its last checkpoint" + (f", all {world} ranks" if world > 1 else "")
        self.say(f"{proc.name} (pid {proc.pid}) {describe_exit(code)}{why}; restart {role.restarts} of "
                 f"{role.name} in {delay:g} s ({what}; see {proc.log_path})")

    def _victim_of_trainer(self, role: _Role, code: int, now: float) -> bool:
        """A generator or drafter trainer that exited because the trainer was away (down, or restarted
        recently): its restart is not its own failure and is not counted against ``max_restarts``."""
        if is_trainer_rank(role.name) or code not in (EXIT_OK, EXIT_PEER_LOST):
            return False
        trainer = self.roles["trainer"]
        recent = 2 * self.config.network.heartbeat_timeout_s
        return trainer.proc is None or (trainer.restarts > 0 and now - trainer.started_at < recent)

    def _died(self, proc: RoleProcess, code: int, when: str = "") -> LaunchError:
        when = f" {when}" if when else ""
        return LaunchError(f"{proc.name} (pid {proc.pid}) {describe_exit(code)}{when}; stopping the run. "
                           f"Last lines of {proc.log_path}:", detail=tail(proc.log_path))

    def _print_metrics(self) -> None:
        """Print the new records of ``RUN_DIR/metrics.jsonl`` (the live progress, ``metrics_tail.py``):
        one line each, then a warning line (to ``out``) for each warning field a record holds."""
        for record in self.metrics_tail.new_records():
            print(format_metrics(record), file=self.metrics_out, flush=True)
            for text in record_warnings(record):
                self.say(f"warning: step {record.get('step', '?')}: {text}")

    # ---- stopping -------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Stop every process (:meth:`_stop_processes`); then, under Ray, every actor and the connection."""
        try:
            self._stop_processes()
        finally:
            if self.cluster is not None:
                self.cluster.close()

    def _stop_processes(self) -> None:
        """SIGTERM every live process group, wait up to ``grace_s``, SIGKILL every group started, reap."""
        live = [p for p in self.processes if observe_exit(p) is None]
        if live:
            self.say(f"stopping {', '.join(p.name for p in live)} (SIGTERM, {self.grace_s:g} s grace)")
        live = terminate(live, self.grace_s, self.poll_s, lambda: self._hurry)
        if live:
            self.say(f"{', '.join(p.name for p in live)} did not stop within {self.grace_s:g} s: SIGKILL")
        for p in self.processes:  # also the exited ones: their groups may hold leftovers
            if not p.reaped:
                killpg(p, signal.SIGKILL)
        for p in self.processes:
            if not p.reaped:
                try:
                    p.exit_code = p.popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.say(f"{p.name} (pid {p.pid}) survived SIGKILL for 30 s (uninterruptible sleep?)")
                    continue
                p.reaped = True
