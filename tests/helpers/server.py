"""The OpenAI-compatible server in the test's event loop, in front of real generator processes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import anyio

from helpers.processes import generator_process
from helpers.timeouts import guard
from specroll.actors.config import RunConfig, load_config
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.server.serving import bind, make_state, serve_http, url_of
from specroll.actors.server.state import ServerState
from specroll.actors.server.weights_update import FolderWeights
from specroll.engine.loaders.checkpoint import load_metadata

HANG_S = guard(120)
"""Longest wait for generators or a reply: only a hang guard, never what a test checks."""


@dataclass
class Served:
    url: str
    """``http://127.0.0.1:PORT/v1``."""
    state: ServerState
    client: RolloutClient
    config: RunConfig
    procs: dict[str, object]
    weights_dir: Path


@contextlib.asynccontextmanager
async def served(model: Path, tmp_path: Path, generators: int = 1, overrides: tuple[str, ...] = (),
                 generator_args: tuple[str, ...] = (), heartbeat_timeout_s: float = 60) -> AsyncIterator[Served]:
    """A server (port 0) and its hub in this loop, ``generators`` generator processes (``gen-0``...)
    connected to it; weights updates from ``tmp_path / "weights"``. The hub's retry rule and queue
    follow ``trainer.max_group_retries`` and ``trainer.max_queued_groups`` (``overrides``)."""
    config = load_config(None, [f'model.name="{model}"', f'run_dir="{tmp_path / "run"}"', "server.port=0",
                                *overrides])
    config_model, tokenizer = load_metadata(model)
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir(exist_ok=True)
    async with RolloutClient(max_groups_in_flight=64, heartbeat_timeout_s=heartbeat_timeout_s,
                             max_group_retries=config.trainer.max_group_retries,
                             max_queued_groups=config.trainer.max_queued_groups) as client:
        update = FolderWeights(client, config_model, weights_dir, 60)
        state = make_state(config, client, tokenizer, config_model, update)
        sock = bind(config.server)
        with ExitStack() as stack:
            procs = {}
            for i in range(generators):
                name = f"gen-{i}"
                procs[name] = stack.enter_context(generator_process(
                    client.endpoint, model, tmp_path / f"{name}.log", "--stream-every", "1", *generator_args,
                    actor_id=name))
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve_http, state, sock)
                await client.wait_for_generators(generators, timeout=HANG_S)
                yield Served(url_of(sock), state, client, config, procs, weights_dir)
                tg.cancel_scope.cancel()
