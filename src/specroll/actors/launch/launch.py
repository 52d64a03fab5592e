"""``specroll launch``: start a whole run on this host — one trainer and N generators as separate
processes — watch them, and tear everything down when the run ends, fails or is interrupted.

Lifecycle:

1. The config is loaded and validated (a ``ConfigError`` is one line, exit 2, nothing started), the
   model, prompts, port and checkpoint are checked and the run directory is locked
   (``preflight.py``), and the config is written resolved to ``RUN_DIR/config.toml``; every
   role reads that file.
2. The trainer starts (``python -m specroll.actors.trainer --config RUN_DIR/config.toml``) after a
   stale ``RUN_DIR/trainer.endpoint`` is removed; once bound it writes its endpoint there, which the
   launcher waits for (``startup_timeout_s``; the trainer dying first ends the launch).
3. ``generator.count`` generators start (``python -m specroll.actors.generator --config ...
   --connect ENDPOINT --actor-id generator-<i>``).
4. Watch: the trainer exiting 0 is the end of the run; any other exit (a generator's, or the
   trainer's with a failure) or SIGINT/SIGTERM to the launcher ends it with a failure report naming
   who died and the tail of its log.
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

from specroll.actors.config import ConfigError, load_config
from specroll.actors.exit_codes import EXIT_OK, EXIT_REFUSED
from specroll.actors.files import write_text_atomic
from specroll.actors.launch.cpu_budget import available_cores, budget_line, with_cpu_budget
from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.preflight import LOCK_FILENAME, preflight, take_lock
from specroll.actors.launch.role_process import RoleProcess, describe_exit, killpg, observe_exit, start_role, tail

if TYPE_CHECKING:
    from specroll.actors.config import RunConfig

__all__ = [
    "ENDPOINT_FILENAME",
    "PIDS_FILENAME",
    "TRAINER_MODULE",
    "Launcher",
    "run_launch",
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


PROGRESS_FIELDS = ("policy_version", "reward_mean", "accuracy", "eval_accuracy", "eval_step", "loss",
                   "logprob_diff_mean", "logprob_kl_k3", "gen_tokens_per_s", "max_lag",
                   "tokens_masked_stale", "samples_dropped_stale", "acceptance_length", "acceptance_length_window",
                   "drafter_version", "step_s", "wait_s")
"""Fields of a metrics record shown in the launcher's progress line, when present (in this order)."""


def format_metrics(record: dict[str, object]) -> str:
    """``"step 3: reward_mean=0.25 loss=0.0132 ..."``: one progress line for a metrics record."""

    def numeric(value: object) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    keys = [k for k in PROGRESS_FIELDS if numeric(record.get(k))]
    if not keys:
        keys = [k for k, v in record.items() if numeric(v) and k != "step"][:10]
    parts = [f"{k}={v:.4g}" if isinstance(v := record[k], float) else f"{k}={v}" for k in keys]
    return f"step {record.get('step', '?')}: {' '.join(parts)}"


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
    """

    config: RunConfig
    trainer_module: str = TRAINER_MODULE
    startup_timeout_s: float = 300.0
    grace_s: float = 15.0
    poll_s: float = 0.1
    out: IO[str] = field(default_factory=lambda: sys.stderr)
    metrics_out: IO[str] = field(default_factory=lambda: sys.stdout)
    processes: list[RoleProcess] = field(default_factory=list, init=False)
    """Every process started, in start order (the trainer first)."""
    _signal: int | None = field(default=None, init=False, repr=False)
    _hurry: bool = field(default=False, init=False, repr=False)
    _metrics_offset: int = field(default=0, init=False, repr=False)
    _reported: set[str] = field(default_factory=set, init=False, repr=False)
    """Non-essential processes whose exit was already reported."""

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
            metrics = self.run_dir / METRICS_FILENAME
            self._metrics_offset = metrics.stat().st_size if metrics.exists() else 0
            endpoint_file = self.run_dir / ENDPOINT_FILENAME
            endpoint_file.unlink(missing_ok=True)  # stale, from an earlier run
            trainer = self._spawn("trainer", [self.trainer_module, "--config", str(config_path)])
            endpoint = local_endpoint(self._wait_endpoint(trainer, endpoint_file))
            self.say(f"trainer listening at {endpoint}")
            for i in range(self.config.generator.count):
                self._spawn(f"generator-{i}", [GENERATOR_MODULE, "--config", str(config_path), "--connect", endpoint,
                                               "--actor-id", f"generator-{i}"])
            if self.config.runs_drafter_trainer():
                self._spawn(DRAFTER_ROLE, [DRAFTER_MODULE, "--config", str(config_path), "--connect", endpoint,
                                           "--actor-id", "drafter-0"])
            return self._watch(trainer)
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

    def _spawn(self, name: str, module_args: list[str]) -> RoleProcess:
        """Start ``python -m module_args...`` as ``name`` in its own process group, output to its log."""
        self._check_signal()
        log_path = self.run_dir / LOGS_DIRNAME / f"{name}.log"
        proc = start_role(name, module_args, log_path)
        self.processes.append(proc)
        pids = {"launcher": os.getpid(), "processes": {p.name: p.pid for p in self.processes}}
        write_text_atomic(self.run_dir / PIDS_FILENAME, json.dumps(pids, indent=1) + "\n")
        self.say(f"started {name} (pid {proc.pid}), log: {log_path}")
        return proc

    def _wait_endpoint(self, trainer: RoleProcess, path: Path) -> str:
        """The endpoint the trainer wrote to ``path``, once it is there."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            self._check_signal()
            if path.exists():
                text = path.read_text(errors="replace").strip()
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

    # ---- watching -------------------------------------------------------------------------------

    def _watch(self, trainer: RoleProcess) -> int:
        """Until the trainer exits 0 (return 0) or anything else ends the run (raise LaunchError)."""
        while True:
            self._check_signal()
            self._print_metrics()
            code = observe_exit(trainer)  # first: generators may notice the trainer's end on their own
            if code == 0:
                self._print_metrics()
                steps = self.config.steps
                self.say(f"the trainer finished {steps} step{'s' if steps != 1 else ''}; stopping the generators")
                return EXIT_OK
            if code is not None:
                raise self._died(trainer, code)
            for proc in self.processes:
                code = observe_exit(proc)
                if code is not None and proc.name == DRAFTER_ROLE:
                    if proc.name not in self._reported:
                        self._reported.add(proc.name)
                        self.say(f"warning: the drafter trainer (pid {proc.pid}) {describe_exit(code)}; generation "
                                 f"and training go on with the last drafter version (see {proc.log_path})")
                elif code is not None:
                    raise self._died(proc, code)
            time.sleep(self.poll_s)

    def _died(self, proc: RoleProcess, code: int, when: str = "") -> LaunchError:
        when = f" {when}" if when else ""
        return LaunchError(f"{proc.name} (pid {proc.pid}) {describe_exit(code)}{when}; stopping the run. "
                           f"Last lines of {proc.log_path}:", detail=tail(proc.log_path))

    def _print_metrics(self) -> None:
        """One line per new record of ``RUN_DIR/metrics.jsonl`` (the live progress): the fields of
        :data:`PROGRESS_FIELDS` it has, else its first numeric fields."""
        path = self.run_dir / METRICS_FILENAME
        try:
            with path.open("rb") as f:
                f.seek(self._metrics_offset)
                data = f.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._metrics_offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                print(format_metrics(record), file=self.metrics_out, flush=True)

    # ---- stopping -------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """SIGTERM every live process group, wait up to ``grace_s``, SIGKILL every group started, reap."""
        live = [p for p in self.processes if observe_exit(p) is None]
        if live:
            self.say(f"stopping {', '.join(p.name for p in live)} (SIGTERM, {self.grace_s:g} s grace)")
        for p in live:
            killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while live and time.monotonic() < deadline and not self._hurry:
            time.sleep(self.poll_s)
            live = [p for p in live if observe_exit(p) is None]
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


def run_launch(config_path: str, overrides: list[str], *, trainer_module: str = TRAINER_MODULE,
               startup_timeout_s: float = 300.0, grace_s: float = 15.0) -> int:
    """``specroll launch``: validate the config (one error line and exit 2, nothing started), run."""

    try:
        config = load_config(config_path, overrides)  # every role reads this same config: checked once here
    except ConfigError as e:
        print(f"specroll launch: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        done = preflight(config)
    except LaunchError as e:
        print(f"specroll launch: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if done is not None:
        print(f"specroll launch: {done}", file=sys.stderr)
        return 0
    lock = Path(config.run_dir) / LOCK_FILENAME
    try:
        take_lock(lock)
    except LaunchError as e:
        print(f"specroll launch: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    cores = available_cores()
    config = with_cpu_budget(config, cores)
    try:
        launcher = Launcher(config, trainer_module=trainer_module, startup_timeout_s=startup_timeout_s,
                            grace_s=grace_s)
        launcher.say(budget_line(config, cores))
        return launcher.run()
    finally:
        lock.unlink(missing_ok=True)


