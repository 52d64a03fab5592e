"""The parsers of the offline jobs ``specroll generate``, ``specroll init-drafter`` and ``specroll
drafter init`` (parsed before any heavy import, as the rest of the command)."""

from __future__ import annotations

import argparse

from specroll.actors.shared.arg_types import positive_float, positive_int


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate rollouts for a set of prompts and write them as JSONL",
        description="Generate n rollouts per prompt with the specroll engine and write them, with "
        "token ids, behavior logprobs and policy versions, to a JSONL file.",
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name, Hugging Face checkpoint directory or .gguf file (default: %(default)s)")
    p.add_argument("--prompts", default=None,
                   help="JSONL file with a 'question' or 'prompt' per line (GSM8K works as is); "
                        "default: the built-in arithmetic task")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--num-builtin", type=positive_int, default=16,
                   help="prompts in the built-in task when --prompts is not given (default: %(default)s)")
    p.add_argument("--n", type=positive_int, default=4, help="samples per prompt (a group; default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=256,
                   help="response tokens at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 disables (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="base seed; sample i of prompt j is seeded from it")
    p.add_argument("--reward", choices=["gsm8k", "none"], default="gsm8k",
                   help="reward of each rollout: last number in the response vs the answer (default: %(default)s)")
    p.add_argument("--out", default="runs/rollouts.jsonl", help="output JSONL (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences per step at most")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV-cache memory in GiB (default: %(default)s)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length cap in tokens (default: the checkpoint's)")
    p.add_argument("--speculative", choices=["off", "suffix", "eagle", "tree", "auto"], default="off",
                   help="speculative decoding, verified losslessly: suffix = model-free drafts from the "
                        "sequence, its group siblings and earlier rollouts of the prompt; eagle = a chain of "
                        "drafts from the learned drafter in --drafter; tree = a draft tree from it every step "
                        "(the first --draft-trees shape); auto = eagle if --drafter is given, else suffix, "
                        "with the chain length or tree shape chosen each step by measured tokens/s (no "
                        "drafts when drafting doesn't pay) (default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=4,
                   help="drafts per sequence and step; the most with --speculative auto (default: %(default)s)")
    p.add_argument("--draft-trees", type=lambda s: tuple(s.split(",")), default=("2x4:6:sampled", "4x4:12:sampled"),
                   help="draft-tree shapes DEPTHxWIDTH:NODES (top-k children) or DEPTHxWIDTH:NODES:sampled "
                        "(a sampling request's children drawn from the drafter's q), comma-separated, for "
                        "--speculative tree / auto with a drafter (default: 2x4:6:sampled,4x4:12:sampled)")
    p.add_argument("--drafter", default=None,
                   help="EAGLE drafter directory (config.json + model.safetensors), e.g. from "
                        "'specroll init-drafter'")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights and KV cache (default: %(default)s, see Precision in docs/generating.md)")
    p.add_argument("--backend", choices=["auto", "torch", "flashinfer"], default="auto")
    p.add_argument("--compile", choices=["off", "on"], default="off",
                   help="run the decoder compiled (see Compiled steps in docs/generating.md; default: %(default)s)")
    p.add_argument("--compile-cache-dir", default=None,
                   help="where compiled code is kept between runs (default: ~/.cache/specroll/compile)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_init_drafter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "init-drafter",
        help="write a fresh (untrained) EAGLE drafter for a model",
        description="Initialise an EAGLE drafter (one decoder layer on the target's features) for --model, "
        "with a draft vocabulary of the most frequent tokens of a prompt set, and save it to --out.",
    )
    p.add_argument("--model", default="smollm2-135m", help="target model (default: %(default)s)")
    p.add_argument("--out", required=True, help="directory to write config.json and model.safetensors into")
    p.add_argument("--features", choices=["last", "eagle3"], default="eagle3",
                   help="target features: the last hidden state (EAGLE-1) or three layers low/mid/high "
                        "(EAGLE-3) (default: %(default)s)")
    p.add_argument("--architecture", choices=["eagle3", "eagle"], default="eagle3",
                   help="eagle3: EAGLE-3's head (q/k/v over [embedding; feature], its own LM head starting "
                        "as the model's, exportable to vLLM/SGLang with 'drafter export'); eagle: fc(2H->H) "
                        "then a decoder layer, the model's LM head (default: %(default)s)")
    p.add_argument("--draft-vocab-size", type=positive_int, default=None,
                   help="tokens the drafter can propose, at most the model's vocabulary "
                        "(default: 8192, or the whole vocabulary when it is smaller)")
    p.add_argument("--prompts", default=None,
                   help="JSONL prompts whose tokens rank the draft vocabulary (default: the built-in task)")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--num-builtin", type=positive_int, default=256,
                   help="built-in prompts when --prompts is not given (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed")


def add_drafter_init(dsub: argparse._SubParsersAction) -> None:
    """``specroll drafter init`` (a subcommand of ``specroll drafter``)."""
    p = dsub.add_parser(
        "init",
        help="make (or find cached) a warm-start drafter for a run: rollouts of its task, trained within a "
             "CPU-minute budget",
        description="Generate --rollouts responses to the training prompts of a run config's task at its sampling "
        "settings (generator.sampling; temperature 1 by default, as RL samples), train a fresh drafter of its "
        "[drafter] settings on them for --budget-minutes CPU-minutes, and save it in the cache folder under a key "
        "of everything that determines it (the model's files, the task, the sampling and head settings, the "
        "budget, the rollout count, the seed), with warm_start.json beside it. The same inputs again are a cache "
        "hit: no generation, no training. Prints the drafter's folder (use it as drafter.path); 'specroll launch' "
        "runs this itself with drafter.warm_start_minutes > 0.",
    )
    p.add_argument("--config", default=None, metavar="FILE",
                   help="run config TOML (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set drafter.draft_vocab_size=2048 (repeatable)")
    p.add_argument("--model", default=None, help="the model, as --set model.name (default: the config's)")
    p.add_argument("--prompts", default=None,
                   help="JSONL training prompts, as --set task.prompts (default: the config's task)")
    p.add_argument("--seed", type=int, default=None, help="the run seed, as --set seed (default: the config's)")
    p.add_argument("--budget-minutes", type=positive_float, default=None, metavar="M",
                   help="CPU-minutes of training, measured with time.process_time() (every thread counted) "
                        "(default: drafter.warm_start_minutes)")
    p.add_argument("--rollouts", type=positive_int, default=None,
                   help="responses to generate (default: drafter.warm_start_rollouts)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="cache folder (default: drafter.warm_start_cache_dir, else ~/.cache/specroll/drafters)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
