"""``specroll launch``: start a whole run on this host — one trainer and N generators as separate
processes — watch them, and tear everything down when the run ends, fails or is interrupted.

Lifecycle:

1. The config is loaded and validated (a ``ConfigError`` is one line, exit 2, nothing started), the
   model, prompts, port and checkpoint are checked and the run directory is locked
   (``preflight.py``), and the config is written resolved to ``RUN_DIR/config.toml``; every
   role reads that file. With ``drafter.warm_start_minutes`` the drafter's warm start is found in
   its cache or made by a child process first (``warm_start.py``), and the file names it as
   ``drafter.path``.
2. The trainer starts (``python -m specroll.actors.trainer --config RUN_DIR/config.toml``) after a
   stale ``RUN_DIR/trainer.endpoint`` is removed; once bound it writes its endpoint there, which the
   launcher waits for (``startup_timeout_s``; the trainer dying first ends the launch). With
   ``trainer.world_size = N`` > 1 the trainer is N processes started together (``rank_roles.py``):
   rank 0 is the role ``trainer`` (the endpoint, the generators), rank r the role ``trainer-rank<r>``,
   each with ``--rank r --world-size N --master 127.0.0.1:PORT``, a fresh free PORT at every start.
3. ``generator.count`` generators start (``python -m specroll.actors.generator --config ...
   --connect ENDPOINT --actor-id generator-<i>``; ENDPOINT is ``network.peer_endpoint`` when set, a
   relay in front of the trainer).
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
   then SIGKILL to every process group the launcher started, then reap; the metrics lines written
   meanwhile are printed, and ``RUN_DIR/pids.json`` says the launch ended (``role_starts.py``). Once
   anything was started, the last line names the command that draws the run (``specroll report RUN_DIR``).

Beside this module: how each role's process is started — process groups and logs, forked from the
launcher or fresh interpreters, or on Ray nodes — in ``role_starts.py``; what a death leads to in
``supervision.py``; the trainer's endpoint in ``trainer_endpoint.py``. Under Ray
(``[cluster] backend = "ray"``, ``ray_cluster.py``) the trainer's endpoint is read on its node, and
the Ray instance is left (or stopped, when the launch started it) at teardown.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from specroll.actors.launch.cpu_budget import available_cores
from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.gpu_plan import gpu_env
from specroll.actors.launch.metrics_tail import MetricsTail, format_metrics, record_warnings
from specroll.actors.launch.rank_roles import TRAINER_ROLE
from specroll.actors.launch.ray_cluster import RayCluster
from specroll.actors.launch.role_fork import Forker
from specroll.actors.launch.role_process import RoleProcess, killpg, observe_exit, terminate
from specroll.actors.launch.role_starts import (
    DRAFTER_MODULE,
    GENERATOR_MODULE,
    LOGS_DIRNAME,
    TRAINER_MODULE,
    RoleStarts,
)
from specroll.actors.launch.supervision import DRAFTER_ROLE, Supervisor
from specroll.actors.launch.trainer_endpoint import ENDPOINT_FILENAME, local_endpoint, port_pin, wait_endpoint
from specroll.actors.launch.warm_start import WARM_START_ROLE, make_in_child, resolve_warm_start
from specroll.actors.shared.exit_codes import EXIT_OK, EXIT_REFUSED

if TYPE_CHECKING:
    from specroll.actors.config import RunConfig

__all__ = ["Launcher"]

METRICS_FILENAME = "metrics.jsonl"


def _specroll_command() -> str:
    """How this ``specroll`` was invoked (``.venv/bin/specroll`` after ``make run``, which is not on
    PATH), so the printed command can be pasted as is; plain ``specroll`` when run as a module."""
    invoked = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return str(invoked) if invoked is not None and invoked.name == "specroll" else "specroll"


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
        warm_start: make or find the drafter's warm start before the trainer starts
            (``drafter.warm_start_minutes``, ``warm_start.py``); ``specroll serve`` makes none.
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
    warm_start: bool = True
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

        starts = RoleStarts(self.run_dir, self.say, self._check_signal, self.forker, self.cluster)
        supervisor = Supervisor(self.config, starts, self.say, self.grace_s, self.poll_s,
                                lambda: self._signal is not None)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                config_path = write_resolved(self.config)
                (self.run_dir / LOGS_DIRNAME).mkdir(exist_ok=True)
                if self.warm_start:
                    config_path = self._warm_start(config_path, starts.processes)
            except OSError as e:
                raise LaunchError(f"run_dir={self.config.run_dir!r}: cannot write the run directory "
                                  f"({e.strerror or e}), expected a writable directory", code=EXIT_REFUSED) from e
            self.metrics_tail.skip_existing()  # an earlier launch's lines: not this launch's progress
            endpoint_file = self.run_dir / ENDPOINT_FILENAME
            endpoint_file.unlink(missing_ok=True)  # stale, from an earlier run
            trainer = starts.start_trainer([self.trainer_module, "--config", str(config_path)],
                                           self.config.trainer.world_size)
            endpoint = local_endpoint(wait_endpoint(trainer, endpoint_file, self.startup_timeout_s, self.poll_s,
                                                    self._check_signal, self.cluster))
            self.say(f"trainer listening at {endpoint}")
            starts.roles[TRAINER_ROLE].module_args += port_pin(endpoint, self.config.network.trainer_port)
            if self.config.network.peer_endpoint:
                endpoint = self.config.network.peer_endpoint
                self.say(f"generators and the drafter trainer connect to {endpoint} (network.peer_endpoint)")
            gpus = gpu_env(self.config, DRAFTER_ROLE) if self.cluster is None else {}  # Ray assigns its own
            for i in range(self.config.generator.count):
                name = f"generator-{i}"
                starts.start(name, [GENERATOR_MODULE, "--config", str(config_path), "--connect",
                                    endpoint, "--actor-id", name], gpus.get(name))
            if self.config.runs_drafter_trainer():
                starts.start(DRAFTER_ROLE, [DRAFTER_MODULE, "--config", str(config_path), "--connect", endpoint,
                                            "--actor-id", "drafter-0"], gpus.get(DRAFTER_ROLE))
            if self.config.launch.max_restarts and not self.config.trainer.checkpoint_every:
                self.say("note: trainer.checkpoint_every = 0, so a restarted trainer starts over from step 0")
            return self._watch(supervisor)
        except LaunchError as e:
            self.say(f"error: {e}")
            if e.detail:
                print(e.detail, file=self.out, flush=True)
            return e.code
        finally:
            try:
                self._teardown(starts.processes)
                self._print_metrics()  # the lines the trainer wrote since the last look, or while it stopped
            finally:
                if starts.processes:  # the file says the launch is over and every process reaped
                    with contextlib.suppress(OSError):
                        starts.write_pids(launcher_running=False)
                for s, handler in previous.items():
                    signal.signal(s, handler)
                if (self.run_dir / METRICS_FILENAME).exists():  # a step (or the evaluation before one) to draw
                    self.say(f"report: {shlex.quote(_specroll_command())} report {shlex.quote(str(self.run_dir))}")

    def _warm_start(self, config_path: Path, processes: list[RoleProcess]) -> Path:
        """The drafter's warm start before any role starts (``warm_start.py``): the resolved config's
        path, written again when it names the warm-start head as ``drafter.path``."""
        from specroll.actors.config import write_resolved

        log = self.run_dir / LOGS_DIRNAME / f"{WARM_START_ROLE}.log"
        # Half the cores, as a role's share of the CPU budget: with every core, torch's threads wait on
        # each other whenever anything else runs (32 rollouts on a busy 2-core machine: 2.9 tok/s with
        # 2 threads, 19 tok/s with 1).
        threads = max(1, available_cores() // 2)
        config = resolve_warm_start(self.config, lambda: make_in_child(
            config_path, log, threads, processes, self._check_signal, self.poll_s), self.say, progress=log)
        if config is self.config:
            return config_path
        self.config = config
        return write_resolved(config)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._signal is not None:
            self._hurry = True  # a second Ctrl-C: skip the grace period
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            raise LaunchError(f"interrupted by {name}; stopping every process", code=128 + self._signal)

    # ---- watching -------------------------------------------------------------------------------

    def _watch(self, supervisor: Supervisor) -> int:
        """Supervise every role until the trainer exits 0 (return 0) or the run fails (raise LaunchError)."""
        while True:
            self._check_signal()
            self._print_metrics()
            trainer = supervisor.starts.roles[TRAINER_ROLE]
            # First: generators may notice the trainer's end on their own and exit.
            code = observe_exit(trainer.proc) if trainer.proc is not None else None
            if code == 0:
                self._print_metrics()
                steps = self.config.steps
                self.say(f"the trainer finished {steps} step{'s' if steps != 1 else ''}; stopping the generators")
                return EXIT_OK
            supervisor.poll()
            time.sleep(self.poll_s)

    def _print_metrics(self) -> None:
        """Print the new records of ``RUN_DIR/metrics.jsonl`` (the live progress, ``metrics_tail.py``):
        one line each, then a warning line (to ``out``) for each warning field a record holds."""
        for record in self.metrics_tail.new_records():
            print(format_metrics(record), file=self.metrics_out, flush=True)
            for text in record_warnings(record):
                self.say(f"warning: step {record.get('step', '?')}: {text}")

    # ---- stopping -------------------------------------------------------------------------------

    def _teardown(self, processes: list[RoleProcess]) -> None:
        """Stop every process (:meth:`_stop_processes`); then, under Ray, every actor and the connection."""
        try:
            self._stop_processes(processes)
        finally:
            if self.cluster is not None:
                self.cluster.close()

    def _stop_processes(self, processes: list[RoleProcess]) -> None:
        """SIGTERM every live process group, wait up to ``grace_s``, SIGKILL every group started, reap."""
        live = [p for p in processes if observe_exit(p) is None]
        if live:
            self.say(f"stopping {', '.join(p.name for p in live)} (SIGTERM, {self.grace_s:g} s grace)")
        live = terminate(live, self.grace_s, self.poll_s, lambda: self._hurry)
        if live:
            self.say(f"{', '.join(p.name for p in live)} did not stop within {self.grace_s:g} s: SIGKILL")
        for p in processes:  # also the exited ones: their groups may hold leftovers
            if not p.reaped:
                killpg(p, signal.SIGKILL)
        for p in processes:
            if not p.reaped:
                try:
                    p.exit_code = p.popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.say(f"{p.name} (pid {p.pid}) survived SIGKILL for 30 s (uninterruptible sleep?)")
                    continue
                p.reaped = True
