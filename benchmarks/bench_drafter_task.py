"""A drafter's acceptance on a run's own task: chains, top-k trees and sampled trees, per drafter.

For each drafter folder given (``specroll drafter init`` or ``drafter train`` made it), an
:class:`~specroll.engine.engine.Engine` of the run config's ``[generator.engine]`` (one thread)
decodes the first ``--prompts`` held-out prompts of the run's task (``eval`` split, the trainer's
chat formatting) at the run's sampling settings (``[generator.sampling]``: T = 1 in the example), one
seed per request, once per arm:

- ``chain``: a chain of ``--num-draft-tokens`` drafts sampled from the head (``draft_length = "fixed"``);
- ``tree:SHAPE`` for each of ``--shapes`` (``draft_length = "tree"``; a ``:sampled`` shape draws
  children from the head's q and verifies them by recursive rejection sampling).

Printed per drafter and arm: the acceptance length (tokens emitted per verify step,
``1 + accepted / draft steps``), drafts and accepted drafts. Acceptance does not depend on timing,
so the figure holds on a busy machine; the seconds printed beside it do not.

Usage (the example's warm start; about 1 minute per arm on one core)::

    python benchmarks/bench_drafter_task.py --config examples/gsm8k_smollm2.toml \\
        ~/.cache/specroll/drafters/KEY
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec
import torch

from specroll.actors.config import ConfigError, load_config
from specroll.actors.jobs.drafter_cache import training_prompts
from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import DrafterError
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.spec.tree import TreeShape
from specroll.protocol.sampling import sample_seed
from specroll.rl.tasks import format_question

DEFAULT_SHAPES = ["4x4:12", "4x4:12:sampled", "2x4:6:sampled"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafters", nargs="+", type=Path, metavar="DRAFTER", help="drafter folders")
    p.add_argument("--config", type=Path, required=True, help="the run config (its model, task and sampling)")
    p.add_argument("--prompts", type=int, default=64, help="held-out prompts (default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="chain length (default: %(default)s)")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help="comma-separated tree shapes (default: %(default)s)")
    args = p.parse_args(argv)
    if args.prompts <= 0 or not 1 <= args.num_draft_tokens <= 16:
        p.error(f"--prompts {args.prompts}, --num-draft-tokens {args.num_draft_tokens}: expected a positive "
                "prompt count and 1 to 16 drafts")
    try:
        args.shapes = [TreeShape.parse(s).text for s in args.shapes.split(",") if s]
    except ValueError as e:
        p.error(f"--shapes: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    try:
        config = load_config(args.config)
        split = training_prompts(config)
    except (ConfigError, ValueError, OSError) as e:
        print(f"bench_drafter_task: {args.config}: {e}", file=sys.stderr)
        return 2
    prompts = split.eval[: args.prompts]
    arms = [("chain", "fixed", ())] + [(f"tree:{s}", "tree", (s,)) for s in args.shapes]
    for drafter in args.drafters:
        for name, mode, trees in arms:
            engine_config = msgspec.structs.replace(
                config.generator.engine, model=config.model.name, seed=config.seed, num_threads=1,
                draft_length=mode, draft_trees=trees or config.generator.engine.draft_trees,
                num_draft_tokens=args.num_draft_tokens)
            try:
                proposer = EagleProposer(drafter, page_size=engine_config.page_size, kv_cache_memory_gb=0.1)
                engine = Engine(engine_config, proposer=proposer)
            except DrafterError as e:
                print(f"bench_drafter_task: {e}", file=sys.stderr)
                return 2
            for n, prompt in enumerate(prompts):
                ids = engine.tokenizer.encode_chat(format_question(prompt.question, split.instruction))
                params = msgspec.structs.replace(config.generator.sampling, seed=sample_seed(config.seed + 1, n))
                engine.add_request(ids, params, str(n))
            start = time.monotonic()
            run_to_completion(engine)
            s = engine.spec_stats
            print(f"{drafter.name}  {name:>20}: acceptance {s.acceptance_length:.3f} "
                  f"({s.num_accepted} of {s.num_drafted} drafts accepted; {time.monotonic() - start:.0f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
