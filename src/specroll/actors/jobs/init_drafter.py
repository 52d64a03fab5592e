"""``specroll init-drafter``: a fresh (untrained) EAGLE drafter for a model, ready for online training.

The head is EAGLE-3's (``--architecture eagle3``, the default; its own LM head starts as the target's
rows of the draft vocabulary) unless ``--architecture eagle`` asks for the older one. The draft
vocabulary is the N target tokens seen most often in a corpus — the prompts (and answers) of a task,
encoded as the generator would — with the end-of-sequence tokens always included; ties, and tokens
the corpus never shows, are ranked by id (byte-level BPE gives frequent merges low ids).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specroll.actors.jobs.generate import GenerateError, _encode_prompt, _load_task
from specroll.drafter.eagle_config import EagleConfig, build_draft_vocab, eagle3_feature_layers
from specroll.drafter.eagle_head import EagleHead
from specroll.engine.loaders.checkpoint import CheckpointError, load_checkpoint


def run_init_drafter(args: argparse.Namespace) -> None:
    """Write an initialised drafter for ``args.model`` into directory ``args.out``.

    Raises:
        GenerateError: bad model, prompts, feature choice or vocabulary size; nothing is written then.
    """
    if not args.out.strip():
        raise GenerateError("--out is empty; expected the directory to write the drafter into")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise GenerateError(f"--out {out} exists and is not a directory")
    prompts = _load_task(args)
    try:
        checkpoint = load_checkpoint(args.model)
    except CheckpointError as exc:
        raise GenerateError(str(exc)) from None
    config = checkpoint.config
    vocab = config.vocab_size
    size = args.draft_vocab_size if args.draft_vocab_size is not None else min(8192, vocab)
    if size > vocab:
        raise GenerateError(f"--draft-vocab-size {size} exceeds the vocabulary of {args.model} ({vocab} tokens)")
    counts = torch.zeros(vocab, dtype=torch.float64)  # [V] occurrences in the corpus
    for p in prompts:
        ids = _encode_prompt(checkpoint.tokenizer, p.question)
        if p.answer:
            ids += checkpoint.tokenizer.encode(p.answer)
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long).clamp(0, vocab - 1), minlength=vocab)
    eos = [t for t in set(checkpoint.tokenizer.eos_token_ids) | set(config.eos_token_ids) if 0 <= t < vocab]
    counts[eos] = float("inf")
    layers = (config.num_layers,) if args.features == "last" else eagle3_feature_layers(config.num_layers)
    try:
        head_config = EagleConfig.for_target(config, layers, size, args.architecture)
    except ValueError as exc:
        raise GenerateError(str(exc)) from None
    d2t = build_draft_vocab(counts, size)
    lm_head = None
    if head_config.architecture == "eagle3":  # its own LM head starts as the target's rows of the draft vocabulary
        name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        lm_head = checkpoint.weights[name].float().index_select(0, d2t)
    head = EagleHead.init(head_config, d2t, seed=args.seed, lm_head=lm_head)
    try:
        head.save(out)
    except OSError as exc:
        raise GenerateError(f"cannot write the drafter to {out}: {exc.strerror or exc}") from None
    print(f"{head_config.architecture} drafter for {args.model}: taps {list(layers)}, draft vocabulary {size} of "
          f"{vocab}, {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M trainable parameters -> {out}")
