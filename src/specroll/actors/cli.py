"""The ``specroll`` command. Arguments are parsed before any heavy import (torch, the model)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specroll.actors.jobs.job_args import add_drafter_init, add_generate, add_init_drafter
from specroll.actors.shared.arg_types import positive_float, positive_int
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.actors.shared.keys_flag import add_keys_argument

if TYPE_CHECKING:
    from specroll.actors.config import RunConfig


def _add_drafter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drafter", help="EAGLE drafters: 'drafter init' (a cached warm start for a run), 'drafter "
                       "train' (offline), 'drafter serve' (online), 'drafter export' / 'drafter import' (the EAGLE-3 "
                       "checkpoint vLLM and SGLang load)",
                       description="Make a run's warm-start drafter, train EAGLE drafters offline, run the online "
                       "drafter trainer, or convert an eagle3 drafter to and from the EAGLE-3 checkpoint vLLM and "
                       "SGLang load.")
    dsub = p.add_subparsers(dest="drafter_command", required=True, metavar="SUBCOMMAND")
    from specroll.actors.drafter_trainer.args import add_arguments

    add_arguments(dsub.add_parser(
        "serve", help="run the drafter trainer actor (connects to a trainer)",
        description="Train the EAGLE drafter online on the trainer's finished rollouts when the generators have "
        "idle capacity and publish drafter versions to them (the generators need generator.speculative = "
        "'eagle' or 'auto').",
    ))
    add_drafter_init(dsub)
    t = dsub.add_parser(
        "train",
        help="train an EAGLE drafter offline from saved rollouts",
        description="Train an EAGLE drafter for --model on the rollouts of a 'specroll generate' JSONL file "
        "(EAGLE-3's training-time test: soft cross-entropy to the model's next-token distribution over the "
        "draft vocabulary, several unrolled draft steps), warm-started from --init or freshly initialised, "
        "and save it to --out.",
    )
    t.add_argument("--rollouts", required=True, metavar="ROLLOUTS.jsonl",
                   help="JSONL with 'prompt_token_ids' and 'token_ids' per line ('specroll generate --out')")
    t.add_argument("--model", required=True, help="target model the rollouts came from")
    t.add_argument("--out", required=True, help="directory to write config.json and model.safetensors into")
    t.add_argument("--init", default=None, help="drafter directory to warm-start from (default: a fresh head)")
    t.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default: %(default)s)")
    t.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    t.add_argument("--batch", type=positive_int, default=8, help="windows per step (default: %(default)s)")
    t.add_argument("--window", type=positive_int, default=512,
                   help="tokens per training window, at least --ttt-steps + 2 (default: %(default)s)")
    t.add_argument("--ttt-steps", type=positive_int, default=3,
                   help="unrolled draft steps of the training-time test (default: %(default)s)")
    t.add_argument("--objective", choices=["kl", "tv", "kl+tv"], default="kl",
                   help="each unrolled step's training term: soft cross-entropy (EAGLE-3), total variation "
                   "(one minus a sampled draft's acceptance probability) or both (default: %(default)s)")
    t.add_argument("--features", choices=["last", "eagle3"], default=None,
                   help="taps of a fresh head, as in init-drafter (default: eagle3; with --init: the head's "
                        "own, and another value is an error)")
    t.add_argument("--draft-vocab-size", type=positive_int, default=None,
                   help="draft vocabulary of a fresh head (default: 8192, or the whole vocabulary when smaller; "
                        "with --init: the head's own, and another value is an error)")
    t.add_argument("--architecture", choices=["eagle3", "eagle"], default=None,
                   help="architecture of a fresh head, as in init-drafter (default: eagle3; with --init: the "
                        "head's own, and another value is an error)")
    t.add_argument("--seed", type=int, default=0, help="initialisation and sampling seed")
    t.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    t.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    e = dsub.add_parser(
        "export",
        help="write an eagle3 drafter as the EAGLE-3 checkpoint vLLM and SGLang load",
        description="Write the eagle3 drafter in DRAFTER as an EAGLE-3 checkpoint folder (config.json with "
        "architectures ['LlamaForCausalLMEagle3'], model.safetensors with midlayer.*, fc, norm, lm_head, d2t, t2d) "
        "for vLLM (speculative_config method 'eagle3') or SGLang (--speculative-algorithm EAGLE3). An 'eagle' "
        "drafter cannot be expressed in that format and is refused. The folder is written whole or not at all.",
    )
    e.add_argument("drafter", metavar="DRAFTER", help="drafter directory (config.json + model.safetensors)")
    e.add_argument("--out", required=True, metavar="DIR", help="new (or empty) directory for the checkpoint")
    e.add_argument("--model", default="smollm2-135m",
                   help="the target model the drafter was made for: checked, and its context length written "
                        "(default: %(default)s)")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the weights in the file (default: %(default)s; the engines cast to theirs)")
    i = dsub.add_parser(
        "import",
        help="read an EAGLE-3 checkpoint (vLLM/SGLang format) into a specroll eagle3 drafter",
        description="Read an EAGLE-3 checkpoint folder ('specroll drafter export', or a trainer such as "
        "SpecForge or SafeAILab/EAGLE) for --model and save it as a specroll drafter: to serve with --drafter, "
        "or to warm-start training from (drafter.path, 'drafter train --init').",
    )
    i.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="EAGLE-3 checkpoint folder (config.json + model.safetensors)")
    i.add_argument("--out", required=True, metavar="DIR", help="directory to write the drafter into")
    i.add_argument("--model", default="smollm2-135m", help="the target model (default: %(default)s)")


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set trainer.group_size=8 (TOML value; repeatable)")


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a whole RL job here: the trainer, N generators and (if enabled) the drafter trainer as "
        "processes, watched",
        description="Start the trainer, generator.count generators and, with drafter.enabled, the drafter "
        "trainer as separate processes (each in its own process group, logs in RUN_DIR/logs/) and supervise "
        "them: one that dies is restarted with a back-off (the trainer from its last checkpoint), each "
        "restart a line here and a count in the metrics ([launch] in the config). Everything stops when "
        "the trainer finishes (exit 0), when a role dies more than launch.max_restarts times within "
        "launch.restart_window_s or is refused its configuration, or on Ctrl-C (exit non-zero, naming who "
        "died).",
    )
    p.add_argument("config", metavar="CONFIG.toml", help="run config, e.g. examples/gsm8k_smollm2.toml")
    _add_set(p)
    p.add_argument("--cluster", choices=("local", "ray"), default=None,
                   help="where the roles run: processes of this host (local) or Ray actors on any node of a Ray "
                        "cluster (ray: needs pip install 'specroll[ray]'; [cluster] in the config, e.g. --set "
                        "cluster.address=auto); the same as --set cluster.backend=...")
    p.add_argument("--startup-timeout-s", type=positive_float, default=300.0,
                   help="seconds the trainer may take to bind and write RUN_DIR/trainer.endpoint "
                        "(default: %(default)s)")
    p.add_argument("--grace-s", type=positive_float, default=15.0,
                   help="seconds processes get to exit after SIGTERM before SIGKILL (default: %(default)s)")
    # Tests only: run a stand-in trainer module instead of specroll.actors.trainer (same contract:
    # --config FILE, writes RUN_DIR/trainer.endpoint once bound, exits 0 when done).
    p.add_argument("--trainer-module", default=None, help=argparse.SUPPRESS)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions, ...) in front of "
        "generator.count generators, watched",
        description="Start the server process (the hub the generators connect to, and HTTP on "
        "server.host:server.port; its URL in RUN_DIR/server.url) and generator.count generators, supervised "
        "as 'specroll launch' does, until Ctrl-C. POST /update_weights publishes a folder of safetensors "
        "under server.weights_dir (default RUN_DIR/weights) as the next policy version.",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="run config TOML (default: the built-in defaults)")
    _add_set(p)
    p.add_argument("--startup-timeout-s", type=positive_float, default=300.0,
                   help="seconds the server may take to bind and write RUN_DIR/trainer.endpoint (default: %(default)s)")
    p.add_argument("--grace-s", type=positive_float, default=15.0,
                   help="seconds processes get to exit after SIGTERM before SIGKILL (default: %(default)s)")


def _add_trainer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trainer",
        help="run the trainer alone (generators connect to it from any host)",
        description="Run the trainer actor: bind tcp://network.host:network.trainer_port, write the bound "
        "endpoint to RUN_DIR/trainer.endpoint, train config.steps steps.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="run config TOML")
    _add_set(p)
    add_keys_argument(p)
    from specroll.actors.trainer.ranks.flags import add_rank_arguments

    add_rank_arguments(p)


def _add_generator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generator",
        help="run one generator alone, connected to a trainer (on any host)",
        description="Run one generator actor with the settings of a run config ([model], [generator], "
        "[network], and [drafter] for drafter.path and drafter.kv_cache_gb), connected to the trainer at "
        "--connect.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="run config TOML")
    p.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                   help="the trainer's endpoint (RUN_DIR/trainer.endpoint on the trainer's host)")
    p.add_argument("--actor-id", default=None, help="unique id (default: generator-<uuid4 hex>)")
    _add_set(p)
    add_keys_argument(p)


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="draw a run's metrics and timeline as PNGs (reward, throughput, staleness, acceptance, timeline)",
        description="Read RUN_DIR/metrics.jsonl and RUN_DIR/timeline.jsonl of a run (finished, killed or still "
        "going) and write reward.png, throughput.png, staleness.png, acceptance.png and timeline.png to --out, "
        "printing each path. A missing file or an unreadable line is one warning on stderr and the rest is "
        "drawn; a run without any metrics record is an error (exit 2).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of 'specroll launch' (its run_dir)")
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the PNGs (default: RUN_DIR/report)")


def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="a run's CURVE keys (network.security = 'curve'): 'keys init RUN_DIR'",
                       description="The keys of a run with network.security = 'curve'.")
    ksub = p.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    i = ksub.add_parser(
        "init", help="make the run's keys in RUN_DIR/keys",
        description="Make the run's CURVE keys in RUN_DIR/keys (or in --out DIR): the trainer's key pair and one "
        "pair per role kind (generator, drafter), ZeroMQ certificate files, folder 0700, files 0600. "
        "'specroll launch' makes them on its first start. A complete keys folder is kept as it is (its keys "
        "stay valid); an incomplete one is an error. Copy to another host only what its roles read: "
        "server.key and generator.key_secret for generators, server.key and drafter.key_secret for the "
        "drafter trainer; server.key_secret never leaves the trainer's host.")
    i.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None,
                   help="the run directory (its run_dir); may be left out with --out")
    i.add_argument("--out", default=None, metavar="DIR", help="the keys folder (default: RUN_DIR/keys)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specroll", description="specroll: a rollout engine for RL on LLMs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate(sub)
    add_init_drafter(sub)
    _add_drafter(sub)
    _add_launch(sub)
    _add_serve(sub)
    _add_trainer(sub)
    _add_generator(sub)
    _add_report(sub)
    _add_keys(sub)
    return parser


def _role_config(args: argparse.Namespace, prog: str) -> RunConfig | None:
    """The run config of ``--config`` (or the defaults) with ``--set`` overrides; ``None`` after
    printing the one error line of a bad config."""
    from specroll.actors.config import ConfigError, load_config
    from specroll.actors.shared.security import keys_overrides

    try:
        return load_config(args.config, [*args.overrides, *keys_overrides(args.keys)])
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` ran (``specroll drafter init``'s for ``drafter init``)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None:
            return parser
        parser = subs[0].choices[chosen]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specroll`` console script; returns the process exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the (sub)command's own usage, not the top level's
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "launch":
        from specroll.actors.launch.entry import TRAINER_MODULE, run_launch

        overrides = [*args.overrides, *([f"cluster.backend={args.cluster}"] if args.cluster else [])]
        return run_launch(args.config, overrides, trainer_module=args.trainer_module or TRAINER_MODULE,
                          startup_timeout_s=args.startup_timeout_s, grace_s=args.grace_s)
    if args.command == "serve":
        from specroll.actors.launch.entry import run_launch

        return run_launch(args.config, args.overrides, trainer_module="specroll.actors.server",
                          startup_timeout_s=args.startup_timeout_s, grace_s=args.grace_s, serving=True)
    if args.command == "keys":
        from specroll.actors.jobs.keys import run_keys_init

        return run_keys_init(args.run_dir, args.out)
    if args.command == "report":
        from specroll.actors.jobs.report import run_report

        return run_report(args.run_dir, args.out)
    if args.command == "trainer":
        from specroll.actors.trainer.cli import serve as serve_trainer

        config = _role_config(args, "specroll trainer")
        return EXIT_REFUSED if config is None else serve_trainer(config, args=args)
    if args.command == "drafter" and args.drafter_command == "serve":
        from specroll.actors.drafter_trainer.args import PROG
        from specroll.actors.drafter_trainer.cli import serve

        config = _role_config(args, PROG)
        return EXIT_REFUSED if config is None else serve(config, args.connect, args.actor_id, args.log_level)
    if args.command == "generator":
        from specroll.actors.generator.cli import GeneratorStart, new_actor_id
        from specroll.actors.generator.cli import serve as serve_generator
        from specroll.actors.peer.endpoint import check_endpoint

        try:
            check_endpoint(args.connect)
        except ValueError as e:
            print(f"specroll generator: error: --connect {e}", file=sys.stderr)
            return EXIT_REFUSED
        config = _role_config(args, "specroll generator")
        if config is None:
            return EXIT_REFUSED
        return serve_generator(GeneratorStart(config, args.connect, new_actor_id(args.actor_id)))

    from specroll.actors.jobs.generate import GenerateError

    if args.command == "generate":
        from specroll.actors.jobs.generate import run_generate as run
    elif args.command == "init-drafter":
        from specroll.actors.jobs.init_drafter import run_init_drafter as run
    elif args.command == "drafter" and args.drafter_command == "export":
        from specroll.actors.jobs.drafter_export import run_drafter_export as run
    elif args.command == "drafter" and args.drafter_command == "import":
        from specroll.actors.jobs.drafter_export import run_drafter_import as run
    elif args.command == "drafter" and args.drafter_command == "init":
        from specroll.actors.jobs.drafter_init import run_drafter_init as run
    elif args.command == "drafter":
        from specroll.actors.jobs.drafter_train import run_drafter_train as run
    else:
        raise AssertionError(f"unhandled command {args.command!r}")
    try:
        run(args)
    except GenerateError as exc:
        name = f"{args.command} {args.drafter_command}" if args.command == "drafter" else args.command
        print(f"specroll {name}: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print(f"specroll {args.command}: interrupted; nothing written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
