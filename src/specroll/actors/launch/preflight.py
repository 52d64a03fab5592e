"""The checks ``specroll launch`` makes before it starts anything: the model, the drafter and the
prompt file load, the drafter fits the model, the trainer's port is free, the run directory's
checkpoint leaves steps to train; and the run directory's lock, so two launches never share one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specroll.actors.drafter_trainer.actor import DRAFTER_DIRNAME
from specroll.actors.launch.errors import LaunchError
from specroll.actors.trainer.checkpoint import CHECKPOINT_DIRNAME, STATE_FILE, read_newest_checkpoint
from specroll.actors.trainer.task_load import load_environment, load_task
from specroll.drafter.eagle_config import DrafterError
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.loaders.checkpoint import CheckpointError, load_model_config
from specroll.engine.loaders.registry import resolve_model
from specroll.engine.loaders.sealed import check_folder, check_replaceable
from specroll.envs.base import EnvironmentLoadError
from specroll.rl.admission import run_ahead_warning
from specroll.rl.tasks import PromptFileError

if TYPE_CHECKING:
    from specroll.actors.config import RunConfig


LOCK_FILENAME = "launch.lock"
"""Holds the pid of the launcher running in a run directory; a second launch there is refused."""


def preflight(config: RunConfig, serving: bool = False) -> str | None:
    """Check what would otherwise fail only after every process started: the model and prompts are
    there, ``drafter.path`` is a drafter made for the model, a cold-started drafter's vocabulary fits
    the model's, the trainer's port is free. Returns a message when there is nothing to do (the run
    directory's checkpoint already reached ``steps``), else None; says so when a run resumes, and
    warns (stderr) when ``trainer.max_groups_in_flight`` is above what the staleness bound lets the
    trainer use (``rl/admission.py``). The server's port is checked too when it serves
    (``server.enabled``, or ``serving``: ``specroll serve``, which trains nothing, so the prompts and
    the checkpoint are not looked at).

    Raises:
        LaunchError: naming the key, the value and what was expected; or every checkpoint of the run
            directory has a file missing or cut short (named).
    """
    check_not_in_use(Path(config.run_dir) / LOCK_FILENAME)  # before a line says what this launch resumes
    try:
        resolve_model(config.model.name)
    except CheckpointError as e:
        raise LaunchError(f"model.name: {e}") from None
    _check_drafter(config)
    if config.cluster.backend == "local":  # under Ray the roles run on nodes this host knows nothing of
        _check_cuda(config)
    tc, engine = config.trainer, config.generator.engine
    if not serving and config.task.environment is None and tc.group_size > engine.max_num_seqs:
        # the run's own generators (one started alone may hold any number; the trainer cannot know)
        raise LaunchError(f"trainer.group_size={tc.group_size}, expected at most generator.engine.max_num_seqs = "
                          f"{engine.max_num_seqs} (a group's samples run on one generator; a larger group would "
                          "never be dispatched)")
    if not serving and tc.mode == "async" and (
            warning := run_ahead_warning(tc.max_groups_in_flight, tc.batch_groups, tc.max_staleness)) is not None:
        print(f"specroll launch: warning: {warning}", file=sys.stderr)
    try:
        if not serving:
            load_task(config)
    except (PromptFileError, ValueError) as e:
        raise LaunchError(f"{_task_key(config, e)}: {e}") from None
    if not serving and config.task.environment is not None:
        try:
            load_environment(config)
        except EnvironmentLoadError as e:
            raise LaunchError(str(e)) from None
    if config.network.trainer_port:
        _check_port(config.network.host, config.network.trainer_port, "network.trainer_port")
    if (serving or config.server.enabled or config.task.environment is not None) and config.server.port:
        _check_port(config.server.host, config.server.port, "server.port")
    _check_metrics(config, serving)
    if serving:
        return None
    for folder in (Path(config.run_dir) / CHECKPOINT_DIRNAME, Path(config.run_dir) / DRAFTER_DIRNAME):
        try:  # else each checkpoint (drafter version) would fail to be written, the run be restarted for nothing
            check_replaceable(folder)
        except FileExistsError as e:
            raise LaunchError(f"{e.filename}: {e.strerror}; move it out of the run directory") from None
    found = read_newest_checkpoint(config.run_dir, _saved_step)
    refused = "".join(f"; refused {e}" for e in found.refused)
    if found.path is None:
        if refused:
            raise LaunchError(f"no usable checkpoint in {config.run_dir}{refused}; move {CHECKPOINT_DIRNAME}/ and "
                              f"{CHECKPOINT_DIRNAME}.prev/ out of the run directory to start again from step 0")
        return None
    step = found.value or 0
    if step >= config.steps:
        return (f"{config.run_dir} holds a checkpoint at step {step}, and steps={config.steps} is the total: "
                f"nothing to train (raise steps to continue, or use another run_dir)")
    print(f"specroll launch: resuming from {found.path} (step {step} of {config.steps}; the metrics of later "
          f"steps are replaced){refused}", file=sys.stderr)
    return None


def _saved_step(checkpoint: Path) -> int:
    """The step of ``checkpoint``, after a check of its files' sizes (the trainer checks every byte).

    Raises:
        ChecksumError: a file missing or of another size than its checksum list says.
    """
    check_folder(checkpoint, contents=False)
    try:
        step = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8")).get("step", 0)
    except (OSError, ValueError, AttributeError):
        return 0  # an unreadable state file: the trainer says what is wrong with it
    return step if isinstance(step, int) else 0


def cuda_keys(config: RunConfig) -> list[str]:
    """The ``key=value`` of each device setting that puts a role this launch starts on CUDA."""
    found = [] if config.trainer.device != "cuda" else [f"trainer.device={config.trainer.device!r}"]
    if config.generator.engine.device.startswith("cuda"):
        found.append(f"generator.engine.device={config.generator.engine.device!r}")
    if config.runs_drafter_trainer() and config.drafter.device.startswith("cuda"):
        found.append(f"drafter.device={config.drafter.device!r}")
    return found


def _check_cuda(config: RunConfig) -> None:
    """A role on CUDA on a host without it would die at start and be restarted to the limit."""
    keys = cuda_keys(config)
    if not keys:
        return
    import torch  # imported by the launcher already (role_fork.prepare); is_available() creates no CUDA context

    if not torch.cuda.is_available():
        raise LaunchError(f"{', '.join(keys)}, but this host has no CUDA device (torch {torch.__version__}); "
                          "expected 'cpu' here, or a CUDA machine")
    engine = config.generator.engine
    if engine.cuda_graphs == "on":  # graphs replay FlashInfer's kernels: without them every start would fail
        from specroll.engine.attention import flashinfer_problem

        dtype = {"float32": torch.float32, "float16": torch.float16}.get(engine.dtype, torch.bfloat16)
        problem = flashinfer_problem(torch.device(engine.device), dtype, head_dim=None)
        if problem is not None:
            raise LaunchError(f"generator.engine.cuda_graphs='on' needs the flashinfer backend, which {problem}; "
                              "expected cuda_graphs = 'off' here")


def _task_key(config: RunConfig, error: Exception) -> str:
    """The config key a prompt-file or split error is about (prompt-file errors name their path)."""
    text = str(error)
    if isinstance(error, EnvironmentLoadError) or text.startswith("task.environment"):
        return "task.environment"
    for key, path in (("eval.prompts", config.eval.prompts), ("task.prompts", config.task.prompts)):
        if path is not None and text.startswith(path):
            return key
    return "eval.prompts" if "without an answer" in text else "eval.count"


def _check_drafter(config: RunConfig) -> None:
    """``drafter.path`` loads and was made for the model; a cold start's ``drafter.draft_vocab_size``
    is at most the model's vocabulary. Reads the model's metadata only when one of them is in use.

    Raises:
        LaunchError: naming the key, the value and what was expected.
    """
    drafter = config.drafter
    cold_start = drafter.enabled and drafter.path is None
    if drafter.path is None and not cold_start:
        return

    try:
        model = load_model_config(config.model.name)
    except CheckpointError as e:
        raise LaunchError(f"model.name: {e}") from None
    if drafter.path is not None:
        try:
            EagleHead.load(drafter.path).check_target(model, f"drafter {drafter.path}")
        except DrafterError as e:
            raise LaunchError(f"drafter.path: {e}") from None
    elif drafter.draft_vocab_size > model.vocab_size:
        raise LaunchError(f"drafter.draft_vocab_size={drafter.draft_vocab_size} exceeds the vocabulary of "
                          f"{config.model.name} ({model.vocab_size} tokens); expected at most {model.vocab_size}")


def check_not_in_use(lock: Path) -> None:
    """Nothing is claimed: only whether a live launcher holds ``lock`` (checked before anything is said
    about the run, then again, atomically, by :func:`take_lock`).

    Raises:
        LaunchError: another live launcher holds it.
    """
    try:
        holder = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return
    if holder > 0 and holder != os.getpid() and _alive(holder):
        raise LaunchError(f"run_dir {lock.parent} is in use by the launcher with pid {holder}; "
                          f"expected a run_dir no running launch uses")


def take_lock(lock: Path) -> None:
    """Claim the run directory for this launcher (O_EXCL), taking over a lock whose launcher is gone.

    Raises:
        LaunchError: another live launcher holds it; the run directory cannot be written (exit 2).
    """
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                check_not_in_use(lock)
                lock.unlink(missing_ok=True)  # stale: its launcher is gone
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return
    except OSError as e:
        raise LaunchError(f"run_dir={str(lock.parent)!r}: cannot write the run directory ({e.strerror or e}), "
                          "expected a writable directory") from e
    raise LaunchError(f"could not claim {lock}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_metrics(config: RunConfig, serving: bool) -> None:
    """``[metrics]``: the sinks' packages are installed, and (on this host, with a fixed base port)
    every role's metrics port is free: the trainer's (or ``specroll serve``'s), the drafter
    trainer's, each generator's."""
    m = config.metrics
    for enabled, key, module, extra in ((m.wandb, "metrics.wandb", "wandb", "wandb"),
                                        (m.tensorboard, "metrics.tensorboard", "tensorboardX", "tensorboard")):
        if enabled and not serving and importlib.util.find_spec(module) is None:
            raise LaunchError(f"{key} = true needs the {module} package: pip install 'specroll[{extra}]' "
                              f"(or set {key} = false)")
    if not m.enabled or not m.port or config.cluster.backend != "local":
        return
    actors = ["trainer", *(f"generator-{i}" for i in range(config.generator.count))]  # serve: "server" = trainer's
    if config.runs_drafter_trainer():
        actors.append("drafter-0")
    for actor in actors:
        _check_port(m.host, m.port_for(actor), f"metrics.port ({actor}'s)")


def _check_port(host: str, port: int, key: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # as the servers bind (ZeroMQ, uvicorn, the metrics endpoint): a port whose last connections
        # wait in TIME_WAIT (a run that just ended) is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as e:
            raise LaunchError(f"{key}={port} on {host}: {e.strerror}; expected a free port (0 picks one)") from None
