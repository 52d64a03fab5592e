"""``specroll drafter train``: train an EAGLE drafter offline from saved rollouts.

Reads the JSONL ``specroll generate`` writes (each line's ``prompt_token_ids`` and ``token_ids``),
warm-starts from ``--init`` (a drafter directory) or initialises a head as ``specroll init-drafter``
does (``--architecture``, EAGLE-3's by default; draft vocabulary: the rollouts' most frequent tokens,
end-of-sequence tokens always in), runs
:class:`specroll.drafter.learner.DrafterLearner` — the online drafter trainer's own code path — and
saves the head to ``--out`` (each file written atomically by ``EagleHead.save``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specroll.actors.jobs.generate import GenerateError
from specroll.drafter.eagle_config import DrafterError, eagle3_feature_layers
from specroll.drafter.eagle_head import EagleHead
from specroll.drafter.learner import DrafterLearner, LearnerConfig
from specroll.engine.device import check_device
from specroll.engine.loaders.checkpoint import CheckpointError, load_checkpoint
from specroll.engine.model import CausalLM


def read_rollouts(path: str) -> list[tuple[list[int], int]]:
    """``(prompt + response token ids, prompt length)`` of each line of a rollouts JSONL file.

    Raises:
        GenerateError: a missing or unreadable file, a malformed line (named by number), a token id
            that is not a non-negative integer (JSON ``true``/``false`` included; named by line, key,
            index and value), or no rollouts.
    """
    p = Path(path)
    if not p.is_file():
        raise GenerateError(f"--rollouts {path}: {'not a file' if p.exists() else 'does not exist'}; "
                            "expected the JSONL 'specroll generate' writes")
    rollouts = []
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerateError(f"--rollouts {path}: cannot read it ({exc})") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, response = row["prompt_token_ids"], row["token_ids"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise GenerateError(f"--rollouts {path}:{n}: expected a JSON object with integer lists "
                                f"'prompt_token_ids' and 'token_ids' ({type(exc).__name__}: {exc})") from None
        for key, ids in (("prompt_token_ids", prompt), ("token_ids", response)):
            problem = _token_ids_problem(ids)
            if problem is not None:
                raise GenerateError(f"--rollouts {path}:{n}: '{key}' {problem}")
        if response:
            rollouts.append((list(prompt) + list(response), len(prompt)))
    if not rollouts:
        raise GenerateError(f"--rollouts {path}: no rollout with response tokens")
    return rollouts


def _token_ids_problem(ids: object) -> str | None:
    """What makes ``ids`` no list of token ids, or None. JSON ``true``/``false`` are refused: ``bool``
    is a subclass of ``int`` in Python, and a plain ``isinstance`` check would read them as 1 and 0."""
    if not isinstance(ids, list):
        return f"is {json.dumps(ids)[:40]}, expected a list of non-negative integers"
    for i, t in enumerate(ids):
        if type(t) is not int or t < 0:
            return f"[{i}] is {json.dumps(t)[:40]}, expected a non-negative integer token id"
    return None


def _taps_name(layers: tuple[int, ...], num_layers: int) -> str:
    """``--features`` naming ``layers`` for a target of ``num_layers`` layers, else the list."""
    named = {"last": (num_layers,), "eagle3": eagle3_feature_layers(num_layers)}
    return next((name for name, taps in named.items() if tuple(layers) == taps), str(list(layers)))


def run_drafter_train(args: argparse.Namespace) -> None:
    """Train a drafter for ``args.model`` on ``args.rollouts`` and save it to ``args.out``.

    Raises:
        GenerateError: a device this machine lacks, a window too short for ``--ttt-steps``, bad
            paths, files, model, a drafter (``--init``) made for another target, or ``--features`` /
            ``--draft-vocab-size`` / ``--architecture`` other than the ``--init`` head's; nothing is
            written then.
    """
    try:
        device = check_device(args.device)
    except ValueError as exc:
        raise GenerateError(str(exc)) from None
    if args.window < args.ttt_steps + 2:  # step i of the unrolled loss predicts x_{t+2+i}
        raise GenerateError(f"--window {args.window} is too short for --ttt-steps {args.ttt_steps}: expected at "
                            f"least --ttt-steps + 2 = {args.ttt_steps + 2} tokens (the first draft predicts x_(t+2))")
    out = Path(args.out)
    if not args.out.strip():
        raise GenerateError("--out is empty; expected the directory to write the drafter into")
    if out.exists() and not out.is_dir():
        raise GenerateError(f"--out {out} exists and is not a directory")
    rows = read_rollouts(args.rollouts)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        checkpoint = load_checkpoint(args.model)
    except CheckpointError as exc:
        raise GenerateError(str(exc)) from None
    config = checkpoint.config
    bad = [n for n, (ids, _) in enumerate(rows, start=1) if max(ids) >= config.vocab_size]
    if bad:
        raise GenerateError(f"--rollouts {args.rollouts}:{bad[0]}: token ids outside the vocabulary of "
                            f"{args.model} ({config.vocab_size} tokens); were these rollouts made with it?")
    model = CausalLM(config)
    model.load_weights(checkpoint.weights)
    model.to(device).eval().requires_grad_(False)
    head = None
    features = args.features if args.features is not None else "eagle3"
    if args.init is not None:
        try:
            head = EagleHead.load(args.init)
            head.check_target(config, f"--init {args.init}")
        except DrafterError as exc:
            raise GenerateError(str(exc)) from None
        # A warm start keeps the head's shape: a flag shaping a fresh head must not be dropped silently.
        taps = _taps_name(head.config.feature_layers, config.num_layers)
        if args.features is not None and args.features != taps:
            raise GenerateError(f"--features {args.features} conflicts with --init {args.init}, whose head taps "
                                f"{taps} (layers {list(head.config.feature_layers)}); expected --features {taps} "
                                f"or no --features with --init")
        arch = head.config.architecture
        if args.architecture is not None and args.architecture != arch:
            raise GenerateError(f"--architecture {args.architecture} conflicts with --init {args.init}, an {arch} "
                                f"head; expected --architecture {arch} or no --architecture with --init")
        size = head.config.draft_vocab_size
        if args.draft_vocab_size is not None and args.draft_vocab_size != size:
            raise GenerateError(f"--draft-vocab-size {args.draft_vocab_size} conflicts with --init {args.init}, whose "
                                f"head drafts from {size} tokens; expected --draft-vocab-size {size} or none with "
                                f"--init")
    elif args.draft_vocab_size is not None and args.draft_vocab_size > config.vocab_size:
        raise GenerateError(f"--draft-vocab-size {args.draft_vocab_size} exceeds the vocabulary of {args.model} "
                            f"({config.vocab_size} tokens)")
    try:
        learner_config = LearnerConfig(
            lr=args.lr, batch=args.batch, window=args.window, ttt_steps=args.ttt_steps, seed=args.seed,
            objective=args.objective,
            buffer_rollouts=len(rows), min_rollouts=1, max_context=max(1024, args.window), features=features,
            draft_vocab_size=args.draft_vocab_size if args.draft_vocab_size is not None else 8192,
            architecture=args.architecture if args.architecture is not None else "eagle3",
        )
    except ValueError as exc:
        raise GenerateError(str(exc)) from None
    eos = set(checkpoint.tokenizer.eos_token_ids) | set(config.eos_token_ids)
    learner = DrafterLearner(model, learner_config, head=head, eos_token_ids=sorted(eos))
    for ids, n in rows:
        learner.add_rollout(ids, n)
    log_every = max(1, args.steps // 10)
    history = [m for i in range(args.steps) if (m := learner.step()) and (i % log_every == 0 or i == args.steps - 1)]
    assert learner.head is not None
    head = learner.head
    try:
        head.save(out)
    except OSError as exc:
        raise GenerateError(f"cannot write the drafter to {out}: {exc.strerror or exc}") from None
    first, last = history[0], history[-1]
    print(f"drafter trained on {len(rows)} rollouts for {args.steps} steps: loss {first['loss']:.3f} -> "
          f"{last['loss']:.3f}, top-1 agreement (step 0) {first['top1_0']:.3f} -> {last['top1_0']:.3f} -> {out}")
