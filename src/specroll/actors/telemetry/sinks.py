"""The trainer's W&B and TensorBoard sinks: each ``metrics.jsonl`` record, flattened to scalars, logged at
its step.

* :func:`flatten_record` turns a record into ``{key: number}`` under the keys of ``metrics.jsonl``
  (nested dicts as ``staleness/0``, ``generator_versions/generator-0``).
* :class:`RecordSinks` opens whichever of ``[metrics] wandb`` and ``[metrics] tensorboard`` the config
  enables. A record of a skipped batch (``"skipped": true``) is not logged: the step's own line follows
  it with the same step number.
* W&B (``RUN_DIR/wandb``): one W&B run per run directory, its id kept in ``RUN_DIR/wandb_id.txt``, so a
  restarted trainer resumes it (online; offline, each trainer process writes an ``offline-run-*``
  directory of that id). Each record is logged at W&B step = its ``step`` (``_step``, the charts' x-axis,
  as in TensorBoard and ``metrics.jsonl``). W&B refuses a step below one it has, and a trainer resumed
  from a checkpoint logs the steps after it again: a record whose step is below the W&B run's next step
  (one past the last this process logged, or where a resumed online run stands) is left out, so W&B keeps
  the first values of the steps trained again.
* TensorBoard (``RUN_DIR/tensorboard``): an event file per trainer process, one event per record, on
  disk when :meth:`RecordSinks.write` returns. The file starts with a session start at its first
  record's step (``SummaryWriter``'s ``purge_step``), so TensorBoard hides what an earlier trainer of the
  run wrote at that step and after: the steps trained again replace theirs, as in ``metrics.jsonl``.
* A sink that fails while writing (W&B's service died, a full disk) is logged once and disabled: the
  trainer goes on.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, Protocol

import msgspec

from specroll.actors.config import RunConfig
from specroll.actors.shared.files import write_text_atomic

log = logging.getLogger("specroll.metrics")

MAX_SCALARS = 512
"""At most this many scalars per record (:func:`flatten_record`): the first ones in the record's
order; a record is about 50, plus one per lag and per generator."""
WANDB_DIRNAME = "wandb"
"""Under the run directory: W&B's files (``offline-run-*`` or ``run-*``, one per trainer process)."""
WANDB_ID_FILENAME = "wandb_id.txt"
"""Under the run directory: the id of the run's W&B run, made at its first start."""
TENSORBOARD_DIRNAME = "tensorboard"
"""Under the run directory: the TensorBoard event files, one per trainer process."""
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SECRET_WORDS = ("key", "secret", "password")


class MetricsSinkUnavailable(RuntimeError):
    """A sink the config enables cannot open: its package is missing (the message names the extra to
    install) or it refused to start (``wandb.init``'s error is the cause)."""


def flatten_record(record: Mapping[str, object]) -> dict[str, float]:
    """The numeric scalars of a ``metrics.jsonl`` record, under its keys.

    Nested dicts become ``parent/child`` keys (``staleness/0``, ``generator_versions/generator-0``); bools
    become 0/1, ints stay ints; ``None``, strings, lists and non-finite floats are left out. At most
    :data:`MAX_SCALARS`, the first ones in the record's order.
    """
    flat: dict[str, float] = {}
    _flatten(record, "", flat)
    return flat


def _flatten(values: Mapping[Any, object], prefix: str, flat: dict[str, float]) -> None:
    for key, value in values.items():
        if len(flat) >= MAX_SCALARS:
            return
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, name + "/", flat)
        elif isinstance(value, bool):  # before Integral: a bool is one
            flat[name] = int(value)
        elif isinstance(value, numbers.Integral):
            flat[name] = int(value)
        elif isinstance(value, numbers.Real) and math.isfinite(value):
            flat[name] = float(value)


class _Sink(Protocol):
    name: str

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class RecordSinks:
    """The sinks of the trainer's records the config enables (none: every call does nothing).

    Use :meth:`open`, then :meth:`write` each record after it is appended to ``metrics.jsonl``, and
    :meth:`close` at exit (or use it as a context manager).
    """

    def __init__(self, sinks: list[_Sink]) -> None:
        self._sinks = sinks
        self._warned_bound = False

    @classmethod
    def open(cls, config: RunConfig, run_dir: Path) -> RecordSinks:
        """Open the sinks ``config.metrics`` enables for the run in ``run_dir`` (made if missing).

        W&B starts (or resumes) the run's W&B run: ``wandb_mode = "offline"`` touches no network.

        Raises:
            MetricsSinkUnavailable: ``metrics.wandb`` without the ``wandb`` package, ``metrics.tensorboard``
                without ``tensorboardX``, or ``wandb.init`` failed (online without credentials, ...).
            ValueError: ``RUN_DIR/wandb_id.txt`` holds no valid W&B run id.
            OSError: ``run_dir`` cannot be made or written.
        """
        metrics = config.metrics
        wandb = _package("wandb", "metrics.wandb", "wandb") if metrics.wandb else None
        tensorboardx = _package("tensorboardX", "metrics.tensorboard", "tensorboard") if metrics.tensorboard else None
        sinks: list[_Sink] = []
        if wandb is None and tensorboardx is None:
            return cls(sinks)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if wandb is not None:
                sinks.append(_WandbSink(wandb, config, run_dir))
            if tensorboardx is not None:
                sinks.append(_TensorBoardSink(run_dir / TENSORBOARD_DIRNAME))
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    @property
    def names(self) -> tuple[str, ...]:
        """The live sinks: ``wandb``, ``tensorboard`` (a failed one is gone)."""
        return tuple(sink.name for sink in self._sinks)

    def write(self, record: Mapping[str, object]) -> None:
        """Log ``record``'s scalars (:func:`flatten_record`) at its ``step``; a skipped batch's record is
        not logged. A sink that raises is logged once and disabled, never raised.

        Raises:
            ValueError: ``record["step"]`` is not an int.
        """
        if not self._sinks or record.get("skipped"):
            return
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"metrics record: 'step' = {step!r}; expected the step number (an int)")
        scalars = flatten_record(record)
        if len(scalars) >= MAX_SCALARS and not self._warned_bound:
            self._warned_bound = True
            log.warning("metrics: a record of step %d has %d scalars or more; the sinks get the first %d",
                        step, MAX_SCALARS, MAX_SCALARS)
        for sink in list(self._sinks):
            try:
                sink.write(step, scalars)
            except Exception as err:  # a dashboard must not end the training
                self._sinks.remove(sink)
                log.warning("metrics: the %s sink failed at step %d (%s: %s); it is off for the rest of this "
                            "trainer's run (metrics.jsonl goes on)", sink.name, step, type(err).__name__, err)

    def close(self) -> None:
        """Finish the W&B run (and stop wandb's service process) and close the TensorBoard writer; a
        failure is logged, not raised. Calling it again does nothing."""
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as err:  # at exit: the trainer's own outcome matters more
                log.warning("metrics: closing the %s sink failed (%s: %s)", sink.name, type(err).__name__, err)

    def __enter__(self) -> RecordSinks:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _package(module: str, key: str, extra: str) -> ModuleType:
    """Import an optional sink's package, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MetricsSinkUnavailable(f"{key} = true needs the {module} package: pip install 'specroll[{extra}]' "
                                     f"(or set {key} = false)") from err


def public_config(config: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data, without the fields whose names hold ``key``, ``secret`` or
    ``password`` (``server.api_key``, ``metrics.api_key``, ``network.keys_dir``): what W&B may store."""
    return _public(msgspec.to_builtins(config))


def _public(table: dict[str, Any]) -> dict[str, Any]:
    return {name: _public(value) if isinstance(value, dict) else value for name, value in table.items()
            if not any(word in name.lower() for word in _SECRET_WORDS)}


def wandb_run_id(run_dir: Path, new_id: str) -> str:
    """The run's W&B run id from ``RUN_DIR/wandb_id.txt``; when there is none, ``new_id``, written there.

    Raises:
        ValueError: the file holds no valid id (1-64 letters, digits, ``_`` or ``-``).
    """
    path = run_dir / WANDB_ID_FILENAME
    if path.is_file():
        run_id = path.read_text(encoding="utf-8").strip()
        if not _RUN_ID.fullmatch(run_id):
            raise ValueError(f"{path}: W&B run id {run_id[:80]!r}; expected 1-64 letters, digits, '_' or '-' "
                             "(delete the file to start a new W&B run)")
        return run_id
    write_text_atomic(path, new_id + "\n")
    return new_id


class _WandbSink:
    """The run's W&B run, each record at W&B step = its ``step`` (see the module's note)."""

    name = "wandb"

    def __init__(self, wandb: ModuleType, config: RunConfig, run_dir: Path) -> None:
        metrics = config.metrics
        run_id = wandb_run_id(run_dir, secrets.token_hex(6))
        try:
            # Quiet and light: no console capture, no system-metrics sampling.
            settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
            self._run = wandb.init(
                project=metrics.wandb_project, name=metrics.wandb_run_name or run_dir.resolve().name,
                dir=str(run_dir), mode=metrics.wandb_mode, config=public_config(config), id=run_id,
                resume="allow", settings=settings)
        except Exception as err:
            raise MetricsSinkUnavailable(f"metrics.wandb: wandb.init failed in {metrics.wandb_mode} mode "
                                         f"({type(err).__name__}: {err})") from err
        self._wandb = wandb
        self._next_step = self._run.starting_step  # a resumed online run's next step; 0 offline
        self._warned_behind = False

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if step < self._next_step:  # W&B would refuse it (with a warning of its own each time)
            if not self._warned_behind:
                self._warned_behind = True
                log.info("metrics: W&B already has step %d (its next step is %d): the steps trained again are "
                         "left out there (metrics.jsonl and TensorBoard have them)", step, self._next_step)
            return
        self._run.log(scalars, step=step, commit=True)  # commit: on its way now, not at the next step
        self._next_step = step + 1

    def close(self) -> None:
        try:
            self._run.finish()
        finally:
            self._wandb.teardown()  # its service process would otherwise outlive the run until exit


class _TensorBoardSink:
    """Scalars in ``RUN_DIR/tensorboard``: one event per record, on disk (fsynced) when :meth:`write`
    returns. tensorboardX's ``SummaryWriter`` hands events to a thread through a queue that its
    ``flush()`` does not wait for, so its synchronous ``EventsWriter`` is used with the event protos."""

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        # The optional package: open() has imported it.
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        logdir.mkdir(parents=True, exist_ok=True)
        self._events_writer, self._event, self._session_log, self._summary = EventsWriter, Event, SessionLog, Summary
        self._logdir = logdir
        self._writer: Any = None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self._writer is None:
            # One file per process; the suffix keeps two made in the same second (they are named by the
            # second) apart. Its first event is a session start at this step: TensorBoard then hides the
            # events of earlier files at this step and after (a trainer resumed from a checkpoint trains
            # them again), as SummaryWriter's purge_step does.
            self._writer = self._events_writer(str(self._logdir / "events"),
                                               f".{os.getpid()}.{secrets.token_hex(4)}")
            self._writer.write_event(self._event(step=step, wall_time=time.time(),
                                                 session_log=self._session_log(status=self._session_log.START)))
        values = [self._summary.Value(tag=key, simple_value=value) for key, value in scalars.items()]
        self._writer.write_event(self._event(step=step, wall_time=time.time(), summary=self._summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
