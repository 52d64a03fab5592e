"""The generator's command line and run-config mapping: ``python -m specroll.actors.generator`` and
``specroll generator`` (flags only, or ``--config FILE [--set a.b=v]`` with explicit flags overriding).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio

from specroll.actors.generator.actor import run_generator
from specroll.actors.generator.settings import GeneratorSettings

if TYPE_CHECKING:
    from specroll.actors.config.schema import RunConfig


def settings_from_config(config: RunConfig, connect: str, actor_id: str = "") -> dict[str, object]:
    """The :class:`GeneratorSettings` fields a run config sets (``--config`` mode), as keyword arguments.

    ``[generator.engine]`` gives the engine (its ``model`` is the config's ``model.name``),
    ``[generator]`` the streaming, heartbeat, KV policy and speculation, ``[network]`` the credit
    window and the trainer timeout (``heartbeat_timeout_s``), ``[drafter]`` the warm-start drafter
    and its K/V memory. ``speculative = "auto"`` means ``eagle`` with a drafter (``drafter.enabled``
    or ``drafter.path``), else ``suffix``.
    """
    engine, gen = config.generator.engine, config.generator
    speculative = gen.speculative
    if speculative == "auto":
        speculative = "eagle" if config.drafter.enabled or config.drafter.path is not None else "suffix"
    return dict(
        connect=connect, model=engine.model, actor_id=actor_id, max_num_seqs=engine.max_num_seqs,
        dtype=engine.dtype, speculative=speculative, num_draft_tokens=engine.num_draft_tokens,
        draft_length=engine.draft_length,
        stream_every=gen.stream_every_steps, heartbeat_s=gen.heartbeat_s, kv_policy=gen.kv_policy,
        seed=engine.seed, trainer_timeout_s=config.network.heartbeat_timeout_s, kv_cache_gb=engine.kv_cache_memory_gb,
        max_model_len=engine.max_model_len, device=engine.device, backend=engine.backend,
        num_threads=engine.num_threads, window=config.network.window,
        drafter=config.drafter.path if speculative == "eagle" else None, drafter_kv_cache_gb=config.drafter.kv_cache_gb,
    )


# command-line flag -> GeneratorSettings field; every flag defaults to None = "not given"
_FLAGS: dict[str, str] = {
    "model": "model", "actor_id": "actor_id", "max_num_seqs": "max_num_seqs", "dtype": "dtype",
    "speculative": "speculative", "drafter": "drafter", "num_draft_tokens": "num_draft_tokens",
    "stream_every": "stream_every",
    "heartbeat_s": "heartbeat_s", "stats_s": "stats_s", "kv_policy": "kv_policy", "seed": "seed",
    "trainer_timeout_s": "trainer_timeout_s", "linger_s": "linger_s", "kv_cache_gb": "kv_cache_gb",
    "max_model_len": "max_model_len", "device": "device", "backend": "backend", "threads": "num_threads",
}


def _endpoint(text: str) -> str:
    """argparse type: a ZeroMQ endpoint to connect to."""
    transport, sep, address = text.partition("://")
    if not sep or transport not in ("tcp", "ipc") or not address:
        raise argparse.ArgumentTypeError(f"{text!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    return text


def parse_args(argv: Sequence[str] | None = None) -> GeneratorSettings:
    """Command-line arguments → settings.

    Two modes: flags only (``--connect`` and ``--model`` required), or ``--config FILE [--set a.b=v]``
    where the run config gives the settings (:func:`settings_from_config`) and any explicit flag
    overrides them. A bad flag value or config exits with status 2 and one error line.
    """
    d = GeneratorSettings(connect="", model="", actor_id="-")

    def default(name: str) -> str:
        return f"(default: from --config, else {getattr(d, name)})"

    p = argparse.ArgumentParser(prog="python -m specroll.actors.generator",
                                description="Run one generator actor connected to a trainer.")
    p.add_argument("--connect", required=True, type=_endpoint, help="trainer endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="run config TOML (e.g. RUN_DIR/config.toml): its [model], [generator], [network] and "
                        "[drafter] (path, kv_cache_gb) sections; explicit flags override its values")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. generator.engine.max_num_seqs=8 (repeatable; needs --config)")
    p.add_argument("--model", default=None,
                   help="registered name, checkpoint directory or .gguf file (required without --config)")
    p.add_argument("--actor-id", default=None, help="unique id (default: generator-<uuid4 hex>)")
    p.add_argument("--max-num-seqs", type=int, default=None, help=default("max_num_seqs"))
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None, help=default("dtype"))
    p.add_argument("--speculative", choices=["off", "suffix", "eagle"], default=None, help=default("speculative"))
    p.add_argument("--drafter", default=None, metavar="DIR",
                   help="with --speculative eagle: a drafter directory served from the start (default: none, "
                        "wait for the drafter trainer's versions)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help=default("num_draft_tokens"))
    p.add_argument("--stream-every", type=int, default=None,
                   help=f"engine steps between chunks at most {default('stream_every')}")
    p.add_argument("--heartbeat-s", type=float, default=None, help=default("heartbeat_s"))
    p.add_argument("--stats-s", type=float, default=None, help=default("stats_s"))
    p.add_argument("--kv-policy", choices=["keep", "recompute"], default=None, help=default("kv_policy"))
    p.add_argument("--seed", type=int, default=None, help=default("seed"))
    p.add_argument("--trainer-timeout-s", type=float, default=None,
                   help=f"{default('trainer_timeout_s')}; with --config: network.heartbeat_timeout_s")
    p.add_argument("--linger-s", type=float, default=None, help=default("linger_s"))
    p.add_argument("--kv-cache-gb", type=float, default=None, help=default("kv_cache_gb"))
    p.add_argument("--max-model-len", type=int, default=None, help="context cap (default: the checkpoint's)")
    p.add_argument("--device", default=None, help=default("device"))
    p.add_argument("--backend", choices=["auto", "torch", "flashinfer"], default=None, help=default("backend"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fields: dict[str, object] = {"connect": a.connect}
    if a.config is not None:
        from specroll.actors.config.schema import ConfigError, load_config

        try:
            fields = settings_from_config(load_config(a.config, a.overrides), a.connect)
        except (ConfigError, ValueError) as e:
            print(f"{p.prog}: error: {e}", file=sys.stderr)
            sys.exit(2)
    elif a.overrides:
        p.error("--set needs --config")
    elif a.model is None:
        p.error("--model is required without --config")
    fields.update({field: getattr(a, flag) for flag, field in _FLAGS.items() if getattr(a, flag) is not None})
    try:
        return GeneratorSettings(**fields)  # type: ignore[arg-type]
    except ValueError as e:
        p.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the actor, return its exit code."""
    settings = parse_args(argv)
    return anyio.run(run_generator, settings, backend="asyncio")
