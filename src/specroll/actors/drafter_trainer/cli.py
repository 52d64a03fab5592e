"""The drafter trainer's command line: ``specroll drafter serve`` and ``python -m specroll.actors.drafter_trainer``
(``--connect`` and a run config, ``--config FILE [--set a.b=v]``; no file: the defaults), and the
entry :func:`serve` both call with the loaded config."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from collections.abc import Sequence

import anyio

from specroll.actors.config import ConfigError, RunConfig, load_config
from specroll.actors.drafter_trainer.actor import run_drafter
from specroll.actors.drafter_trainer.args import PROG, add_arguments
from specroll.actors.peer.endpoint import check_endpoint
from specroll.actors.peer.exit import run_stoppable
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.actors.shared.security import keys_overrides, keys_usable
from specroll.actors.telemetry.endpoint import MetricsBindError
from specroll.drafter.eagle_config import DrafterError
from specroll.engine.loaders.checkpoint import CheckpointError


def serve(config: RunConfig, connect: str, actor_id: str | None = None, log_level: str = "INFO",
          prog: str = PROG) -> int:
    """Run the drafter trainer: log to stderr (first the config's :meth:`RunConfig.warnings`), train and
    publish until stopped, return the exit code (2: ``connect`` is no endpoint — a malformed one or a
    port outside [1, 65535] —, the model or the warm-start drafter does not load, or a cold start's
    ``drafter.draft_vocab_size`` exceeds the model's vocabulary)."""
    logging.basicConfig(level=log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_endpoint(connect)
    except ValueError as e:
        print(f"{prog}: error: --connect {e}", file=sys.stderr)
        return EXIT_REFUSED
    for warning in config.warnings():
        logging.getLogger("specroll.drafter").warning("%s", warning)
    if not keys_usable(config, "drafter", prog):
        return EXIT_REFUSED
    actor_id = actor_id or f"drafter-{uuid.uuid4().hex}"
    try:
        return run_stoppable(lambda: anyio.run(run_drafter, config, connect, actor_id, backend="asyncio"),
                             logging.getLogger("specroll.drafter"), "drafter trainer", actor_id)
    except (CheckpointError, DrafterError, MetricsBindError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_REFUSED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the drafter trainer, return its exit code (2: bad input)."""
    p = argparse.ArgumentParser(prog="python -m specroll.actors.drafter_trainer",
                                description="Run the drafter trainer: train the EAGLE drafter online on the "
                                            "trainer's rollouts and publish drafter versions to the generators.")
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        config = load_config(a.config, [*a.overrides, *keys_overrides(a.keys)])
    except ConfigError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return serve(config, a.connect, a.actor_id, a.log_level, p.prog)
