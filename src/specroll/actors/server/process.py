"""The server as an actor: ``specroll serve --config FILE`` runs this process in the trainer's place
(the launcher starts ``generator.count`` generators that connect to its hub), and ``specroll
launch`` with ``[server] enabled`` (or an episode task) serves inside the trainer's process
(``actors/trainer/process.py``).

The process binds the hub, writes ``RUN_DIR/trainer.endpoint`` (the launcher's contract), reads
the model's metadata (no weights: the generators hold them), binds the HTTP port, writes
``RUN_DIR/server.url`` and serves until SIGTERM/SIGINT (exit 128 + the signal). Exit 2 for a bad
config or a port it cannot bind, 1 for a failure.
"""

from __future__ import annotations

import itertools
import logging
import signal
from pathlib import Path

import anyio

from specroll.actors.config import RunConfig, write_resolved
from specroll.actors.rollout.from_config import client_from_config
from specroll.actors.rollout.timeline import TIMELINE_FILENAME, Timeline
from specroll.actors.server.serving import URL_FILENAME, bind, make_state, serve_http
from specroll.actors.server.weights_update import FolderWeights
from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_REFUSED
from specroll.actors.shared.files import write_text_atomic
from specroll.actors.shared.signals import cancel_on_stop_signal
from specroll.actors.telemetry.endpoint import open_endpoint
from specroll.actors.telemetry.server_metrics import collect_hub, collect_server
from specroll.engine.loaders.checkpoint import CheckpointError, load_metadata
from specroll.protocol.curve import KeysError

log = logging.getLogger("specroll.server")

ENDPOINT_FILENAME = "trainer.endpoint"
"""The hub's endpoint file, the same as the trainer's (the launcher waits for it)."""


async def run_server(config: RunConfig) -> int:
    """Run ``specroll serve``'s process to the end (module docstring); return the exit code."""
    run_dir = Path(config.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_resolved(config)
        model, tokenizer = load_metadata(config.model.name)
        sock = bind(config.server)
    except (CheckpointError, OSError) as e:
        log.error("server refused: %s", e)
        return EXIT_REFUSED
    timeline = Timeline(run_dir / TIMELINE_FILENAME)
    try:
        client = client_from_config(config, timeline)
    except KeysError as e:
        log.error("server refused: %s", e)
        sock.close()
        timeline.close()
        return EXIT_REFUSED
    code = EXIT_FAILED
    try:
        async with client, anyio.create_task_group() as tg:
            write_text_atomic(run_dir / ENDPOINT_FILENAME, client.endpoint)
            weights_dir = Path(config.server.weights_dir or run_dir / "weights")
            weights_dir.mkdir(parents=True, exist_ok=True)
            update = FolderWeights(client, model, weights_dir, config.server.weights_timeout_s)
            state = make_state(config, client, tokenizer, model, update)

            def stopped(sig: signal.Signals) -> None:
                nonlocal code
                log.info("server stopped by %s", sig.name)
                code = 128 + sig

            try:
                endpoint = open_endpoint(config, "server", "server", lambda: itertools.chain(
                    collect_hub(client, "server", "server"), collect_server(state.router)))
            except OSError as e:
                log.error("server refused: %s", e)
                return EXIT_REFUSED
            cancel_on_stop_signal(tg, stopped)
            log.info("hub listening on %s for generators", client.endpoint)
            try:
                await serve_http(state, sock, run_dir / URL_FILENAME)
            finally:
                if endpoint is not None:
                    endpoint.close()
    except Exception as e:
        log.error("server failed: %s: %s", type(e).__name__, e)
        log.debug("traceback", exc_info=e)
        return EXIT_FAILED
    finally:
        sock.close()
        timeline.close()
    return code
