"""The trainer process: bind the client, write ``RUN_DIR/trainer.endpoint``, load the policy while
generators connect, run :class:`~specroll.actors.trainer.trainer.Trainer` to the end and turn how it
ended into the exit code (the contract with the launcher is in ``trainer.py``'s docstring)."""

from __future__ import annotations

import itertools
import logging
import signal
from pathlib import Path

import anyio
import torch
import torch.distributed as dist

from specroll.actors.config import RunConfig, write_resolved
from specroll.actors.rollout.from_config import client_from_config
from specroll.actors.rollout.timeline import TIMELINE_FILENAME, Timeline
from specroll.actors.server.serving import URL_FILENAME, bind, make_state, serve_http, url_of
from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_REFUSED
from specroll.actors.shared.files import write_text_atomic
from specroll.actors.shared.signals import cancel_on_stop_signal
from specroll.actors.telemetry.endpoint import open_endpoint
from specroll.actors.telemetry.server_metrics import collect_server
from specroll.actors.telemetry.sinks import MetricsSinkUnavailable
from specroll.actors.trainer.episodes import EpisodeRunner
from specroll.actors.trainer.ranks.join import Ranks
from specroll.actors.trainer.setup import TrainerError, load_setup
from specroll.actors.trainer.task_load import load_environment
from specroll.actors.trainer.trainer import Trainer
from specroll.envs.base import Environment, EnvironmentLoadError
from specroll.protocol.curve import KeysError

log = logging.getLogger("specroll.trainer")

ENDPOINT_FILENAME = "trainer.endpoint"
"""Once bound, the trainer writes its endpoint (``tcp://HOST:PORT``) to ``RUN_DIR/trainer.endpoint``."""


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
    run_dir = Path(config.run_dir)
    try:
        client = client_from_config(config, timeline)
    except KeysError as e:
        raise TrainerError(str(e), EXIT_REFUSED) from None
    code = EXIT_OK
    async with client:  # closing it sends Dead to every connected generator
        write_text_atomic(run_dir / ENDPOINT_FILENAME, client.endpoint)
        log.info("trainer listening on %s; loading %s", client.endpoint, config.model.name)
        async with anyio.create_task_group() as tg:

            def stopped(sig: signal.Signals) -> None:
                nonlocal code
                log.error("trainer stopped by %s", sig.name)
                code = 128 + sig

            cancel_on_stop_signal(tg, stopped)
            setup = await anyio.to_thread.run_sync(load_setup, config, ranks, store)  # generators connect meanwhile
            done = False
            runner: EpisodeRunner | None = None
            router = None
            try:
                client.vocab_size = setup.policy.config.vocab_size  # before the Trainer submits its first group
                if config.server.enabled or config.task.environment is not None:  # HTTP in front of the generators
                    state, sock = make_state(config, client, setup.tokenizer, setup.policy.config, None), None
                    try:
                        sock = bind(config.server)
                    except OSError as e:
                        raise TrainerError(f"server: cannot bind {config.server.host}:{config.server.port} ({e})",
                                           EXIT_REFUSED) from None
                    tg.start_soon(serve_http, state, sock, run_dir / URL_FILENAME)
                    router = state.router
                    if config.task.environment is not None:
                        runner = EpisodeRunner(config, state, url_of(sock), _environment(config))
                try:  # the W&B / TensorBoard sinks start here
                    trainer = Trainer(config, setup, client, timeline, runner)
                except MetricsSinkUnavailable as e:
                    raise TrainerError(str(e), EXIT_REFUSED) from None
                export = trainer.records.export
                try:
                    endpoint = open_endpoint(config, "trainer", "trainer", lambda: itertools.chain(
                        export.collect(), collect_server(router) if router is not None else ()))
                except OSError as e:  # its port in use
                    trainer.records.close()
                    raise TrainerError(str(e), EXIT_REFUSED) from None
                try:
                    await trainer.run()
                finally:
                    trainer.records.close()
                    if endpoint is not None:
                        endpoint.close()
                done = True
                log.info("trained %d steps; final policy version %d", trainer.step, trainer.version)
                tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):  # also when cancelled: the other ranks must stop
                    await anyio.to_thread.run_sync(setup.policy.close, done)
                    if runner is not None:
                        with anyio.move_on_after(5):
                            await runner.aclose()
    return code


def _environment(config: RunConfig) -> Environment:
    """``task.environment``, loaded.

    Raises:
        TrainerError: it does not load (exit 2).
    """
    try:
        return load_environment(config)
    except EnvironmentLoadError as e:
        raise TrainerError(str(e), EXIT_REFUSED) from None


def _leaf(e: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (task groups wrap errors)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e
