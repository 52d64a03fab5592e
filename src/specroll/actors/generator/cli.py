"""The generator's command line: ``python -m specroll.actors.generator`` (flags only, or
``--config FILE [--set a.b=v]`` with explicit flags overriding) and the entry :func:`serve` that
``specroll generator`` calls with a loaded config.

There is one parse: every flag is an override of a run-config key (:data:`FLAG_KEYS`), applied after
the file and its ``--set`` items, and the actor reads the resulting :class:`RunConfig`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from specroll.actors.config import ConfigError, RunConfig, load_config, toml_value
from specroll.actors.generator.actor import run_generator
from specroll.actors.peer.endpoint import endpoint_arg
from specroll.actors.peer.exit import run_stoppable
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.actors.shared.keys_flag import add_keys_argument
from specroll.actors.shared.security import keys_overrides, keys_usable
from specroll.actors.telemetry.endpoint import MetricsBindError
from specroll.drafter.eagle_config import DrafterError
from specroll.engine.compiled_step import CompileCacheError
from specroll.engine.loaders.errors import CheckpointError

FLAG_KEYS: dict[str, str] = {
    "model": "model.name",
    "max_num_seqs": "generator.engine.max_num_seqs",
    "dtype": "generator.engine.dtype",
    "speculative": "generator.speculative",
    "drafter": "drafter.path",
    "num_draft_tokens": "generator.engine.num_draft_tokens",
    "stream_every": "generator.stream_every_steps",
    "heartbeat_s": "generator.heartbeat_s",
    "stats_s": "generator.stats_s",
    "kv_policy": "generator.kv_policy",
    "seed": "generator.engine.seed",
    "trainer_timeout_s": "network.heartbeat_timeout_s",
    "reconnect_timeout_s": "network.reconnect_timeout_s",
    "linger_s": "generator.linger_s",
    "kv_cache_gb": "generator.engine.kv_cache_memory_gb",
    "max_model_len": "generator.engine.max_model_len",
    "device": "generator.engine.device",
    "backend": "generator.engine.backend",
    "threads": "generator.engine.num_threads",
}
"""Command-line flag (argparse dest) → the run-config key it overrides; every flag defaults to
``None`` = "not given"."""

FLAG_MODE_BASE: tuple[str, ...] = ("network.heartbeat_timeout_s=60.0", "drafter.enabled=true")
"""Without ``--config``, the defaults are :class:`RunConfig`'s but for these, which keep what a
generator started by flags alone always did: it waits 60 s for an unreachable trainer, and it cannot
know whether the run has a drafter trainer, so ``--speculative eagle`` without ``--drafter`` is
valid (it decodes plainly until the drafter trainer's first version arrives)."""


@dataclass(frozen=True)
class GeneratorStart:
    """What one generator process runs with: the run config and its own identity."""

    config: RunConfig
    connect: str
    """The trainer's ROUTER endpoint, e.g. ``tcp://127.0.0.1:5555``."""
    actor_id: str
    """Unique per process incarnation, also the ZeroMQ identity."""
    log_level: str = "INFO"


def _parser() -> argparse.ArgumentParser:
    def default(key: str) -> str:
        return f"(config key {key})"

    p = argparse.ArgumentParser(prog="python -m specroll.actors.generator",
                                description="Run one generator actor connected to a trainer.")
    p.add_argument("--connect", required=True, type=endpoint_arg, help="trainer endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="run config TOML (e.g. RUN_DIR/config.toml): its [model], [generator], [network] and "
                        "[drafter] (path, kv_cache_gb) sections; explicit flags override its values")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. generator.engine.max_num_seqs=8 (repeatable; needs --config)")
    p.add_argument("--model", default=None,
                   help="registered name, checkpoint directory or .gguf file (required without --config)")
    p.add_argument("--actor-id", default=None, help="unique id (default: generator-<uuid4 hex>)")
    p.add_argument("--max-num-seqs", type=int, default=None, help=default(FLAG_KEYS["max_num_seqs"]))
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help=default(FLAG_KEYS["dtype"]))
    p.add_argument("--speculative", choices=["off", "suffix", "eagle"], default=None,
                   help=default(FLAG_KEYS["speculative"]))
    p.add_argument("--drafter", default=None, metavar="DIR",
                   help="with --speculative eagle: a drafter directory served from the start (default: none, "
                        "wait for the drafter trainer's versions)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help=default(FLAG_KEYS["num_draft_tokens"]))
    p.add_argument("--stream-every", type=int, default=None,
                   help=f"engine steps between chunks at most {default(FLAG_KEYS['stream_every'])}")
    p.add_argument("--heartbeat-s", type=float, default=None, help=default(FLAG_KEYS["heartbeat_s"]))
    p.add_argument("--stats-s", type=float, default=None, help=default(FLAG_KEYS["stats_s"]))
    p.add_argument("--kv-policy", choices=["keep", "recompute"], default=None, help=default(FLAG_KEYS["kv_policy"]))
    p.add_argument("--seed", type=int, default=None, help=default(FLAG_KEYS["seed"]))
    p.add_argument("--trainer-timeout-s", type=float, default=None,
                   help=f"{default(FLAG_KEYS['trainer_timeout_s'])}; without --config: 60")
    p.add_argument("--reconnect-timeout-s", type=float, default=None,
                   help=f"seconds to wait for a trainer that vanished without saying it exits "
                        f"{default(FLAG_KEYS['reconnect_timeout_s'])}; default: max(60, the trainer timeout)")
    p.add_argument("--linger-s", type=float, default=None, help=default(FLAG_KEYS["linger_s"]))
    p.add_argument("--kv-cache-gb", type=float, default=None, help=default(FLAG_KEYS["kv_cache_gb"]))
    p.add_argument("--max-model-len", type=int, default=None, help="context cap (default: the checkpoint's)")
    p.add_argument("--device", default=None, help=default(FLAG_KEYS["device"]))
    p.add_argument("--backend", choices=["auto", "torch", "flashinfer"], default=None,
                   help=default(FLAG_KEYS["backend"]))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_keys_argument(p)
    return p


def new_actor_id(actor_id: str | None) -> str:
    """``actor_id``, or ``generator-<uuid4 hex>`` when none is given."""
    return actor_id or f"generator-{uuid.uuid4().hex}"


def parse_args(argv: Sequence[str] | None = None) -> GeneratorStart:
    """Command-line arguments → the run config and identity, in one parse.

    Two modes: flags only (``--connect`` and ``--model`` required; the defaults are
    :class:`RunConfig`'s with :data:`FLAG_MODE_BASE`), or ``--config FILE [--set a.b=v]``. Either way
    each explicit flag overrides its key (:data:`FLAG_KEYS`) after the file and the ``--set`` items.
    A bad flag value or config exits with status 2 and one error line.
    """
    p = _parser()
    a = p.parse_args(argv)
    if a.config is None and a.overrides:
        p.error("--set needs --config")
    if a.config is None and a.model is None:
        p.error("--model is required without --config")
    if a.drafter is not None and a.speculative not in (None, "eagle"):
        p.error(f"--drafter {a.drafter} needs --speculative eagle (got {a.speculative!r})")
    flags = [f"{key}={toml_value(getattr(a, flag))}" for flag, key in FLAG_KEYS.items()
             if getattr(a, flag) is not None]
    base = () if a.config is not None else FLAG_MODE_BASE
    try:
        config = load_config(a.config, [*base, *a.overrides, *flags, *keys_overrides(a.keys)])
    except ConfigError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    return GeneratorStart(config, a.connect, new_actor_id(a.actor_id), a.log_level)


def serve(start: GeneratorStart) -> int:
    """Run one generator process: log to stderr, serve the trainer until stopped, return the exit code."""
    logging.basicConfig(level=start.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not keys_usable(start.config, "generator", "specroll generator"):
        return EXIT_REFUSED
    try:
        return run_stoppable(
            lambda: anyio.run(run_generator, start.config, start.connect, start.actor_id, backend="asyncio"),
            logging.getLogger("specroll.generator"), "generator", start.actor_id)
    except (CheckpointError, DrafterError, MetricsBindError, CompileCacheError) as e:  # the model or drafter does
        # not load, a port is taken, the compile cache folder is unusable
        print(f"specroll generator: error: {e}", file=sys.stderr)
        return EXIT_REFUSED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the actor, return its exit code."""
    return serve(parse_args(argv))
