"""The trainer process: bind the client, write ``RUN_DIR/trainer.endpoint``, load the policy while
generators connect, run :class:`~specroll.actors.trainer.trainer.Trainer` to the end and turn how it
ended into the exit code (the contract with the launcher is in ``trainer.py``'s docstring)."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import anyio
import torch
import torch.distributed as dist

from specroll.actors.config import RunConfig, write_resolved
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.timeline import TIMELINE_FILENAME, Timeline
from specroll.actors.rollout.weights_groups import BackendChoice
from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_REFUSED
from specroll.actors.shared.files import write_text_atomic
from specroll.actors.trainer.ranks.join import Ranks
from specroll.actors.trainer.setup import TrainerError, load_setup
from specroll.actors.trainer.trainer import Trainer
from specroll.protocol.curve import KeysError

log = logging.getLogger("specroll.trainer")

ENDPOINT_FILENAME = "trainer.endpoint"
"""Once bound, the trainer writes its endpoint (``tcp://HOST:PORT``) to ``RUN_DIR/trainer.endpoint``."""


def _bind_address(config: RunConfig) -> str:
    host = config.network.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"tcp://{host}:{config.network.trainer_port}"


async def run_trainer(config: RunConfig, ranks: Ranks | None = None, store: dist.Store | None = None) -> int:
    """Run the trainer of ``config`` to the end; return the exit code: 0 after ``config.steps``
    steps; otherwise the error is logged in one line and the code is 1 (a failure), 2 (a bad config
    or rank), 3 (no generator) or 128 + the signal number (SIGTERM/SIGINT, watched when called from
    the main thread: training stops, the client still says ``Dead`` to the generators).

    With ``ranks``, this is rank 0 of a sharded trainer: the other ranks (``ranks/follower.py``) are told
    to stop however it ends; ``store`` is the one it met them on (``ranks.join_group``), or None to
    meet them while the policy loads.
    """
    try:
        return await _run(config, ranks, store)
    except Exception as e:  # the actor's death: reported in one line, the traceback at DEBUG
        e = _leaf(e)
        code = e.exit_code if isinstance(e, TrainerError) else EXIT_FAILED
        log.error("trainer failed: %s", e if isinstance(e, TrainerError) else f"{type(e).__name__}: {e}")
        log.debug("traceback", exc_info=e)
        return code


async def _run(config: RunConfig, ranks: Ranks | None, store: dist.Store | None) -> int:
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(config)
    if config.trainer.train_threads is not None:
        torch.set_num_threads(config.trainer.train_threads)
    timeline = Timeline(run_dir / TIMELINE_FILENAME)
    try:
        return await _serve(config, timeline, ranks, store)
    finally:
        timeline.close()


async def _serve(config: RunConfig, timeline: Timeline, ranks: Ranks | None, store: dist.Store | None) -> int:
    run_dir, net = Path(config.run_dir), config.network
    try:
        keys = net.server_keys(config.run_dir)
    except KeysError as e:
        raise TrainerError(str(e), EXIT_REFUSED) from None
    if keys is not None:
        log.info("CURVE security: admitting this run's generator and drafter keys from %s",
                 net.keys_path(config.run_dir))
    if net.insecure_warning() is not None:
        log.warning("%s", net.insecure_warning())
    client = RolloutClient(_bind_address(config), max_groups_in_flight=config.trainer.max_groups_in_flight,
                           heartbeat_timeout_s=net.heartbeat_timeout_s, window=net.window, hwm=net.hwm,
                           allow_public=net.public_bind_allowed(), curve=keys, timeline=timeline,
                           weights_transport=net.weights_transport, weights_bucket_mb=net.weights_bucket_mb,
                           weights_backend=_weights_backend(config))
    code = EXIT_OK
    async with client:  # closing it sends Dead to every connected generator
        write_text_atomic(run_dir / ENDPOINT_FILENAME, client.endpoint)
        log.info("trainer listening on %s; loading %s", client.endpoint, config.model.name)
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                nonlocal code
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.error("trainer stopped by %s", signal.Signals(signum).name)
                        code = 128 + signum
                        tg.cancel_scope.cancel()

            if threading.current_thread() is threading.main_thread():
                tg.start_soon(watch_signals)
            setup = await anyio.to_thread.run_sync(load_setup, config, ranks, store)  # generators connect meanwhile
            done = False
            try:
                client.vocab_size = setup.policy.config.vocab_size  # before the Trainer submits its first group
                trainer = Trainer(config, setup, client, timeline)
                await trainer.run()
                done = True
                log.info("trained %d steps; final policy version %d", trainer.step, trainer.version)
                tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):  # also when cancelled: the other ranks must stop
                    await anyio.to_thread.run_sync(setup.policy.close, done)
    return code


def _weights_backend(config: RunConfig) -> BackendChoice:
    """``network.weights_backend``, with ``auto`` made gloo for a trainer on the CPU (NCCL would
    need its rank 0 on a GPU, whatever devices the machine has)."""
    backend = config.network.weights_backend
    return "gloo" if backend == "auto" and config.trainer.device == "cpu" else backend


def _leaf(e: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (task groups wrap errors)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e
