"""A step's speculation, one class per mode: plain decoding, chain drafts, tree drafts.

Each engine step runs in one mode, which the step's arm names (``draft_length.py`` picks it: 0 is
plain decoding, k > 0 a chain of k drafts, a :class:`TreeShape` a draft tree). The engine calls the
same members of whichever mode it is; the modes differ in nothing else:

- ``lookahead``: the K/V slots past its last token each sampling sequence needs this step, which
  the scheduler reserves: none, k for a chain, one per node for a tree (its nodes take a slot each
  though their positions go only as deep as the tree);
- :meth:`~Speculation.propose`: the step's drafts (``drafts.py``), which the runner appends to each
  decoding sequence's input so that the one target forward of the step scores them too;
- :meth:`~Speculation.verify`: the target's rows → each sampling sequence's emitted tokens and
  their behavior logprobs — plain sampling (``sampler.py``), chain rejection sampling
  (``verify.py``) or the tree walk (``tree.py``), all lossless — with the K/V of rejected drafts
  rolled back and the drafted and accepted counts added to the step's :class:`SpeculativeStats`.

On CUDA, with the engine's FlashInfer sampler, plain sampling and chain verification run through
FlashInfer's kernels (``engine/flashinfer_sampling.py``); the tree walk runs through the torch
reference on every device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specroll.engine.block_manager import BlockManager
from specroll.engine.flashinfer_sampling import FlashInferSampler
from specroll.engine.model_runner import ModelRunner
from specroll.engine.sampler import sample
from specroll.engine.scheduler import ScheduledSequence
from specroll.engine.sequence import Sequence
from specroll.engine.spec.draft_length import Arm
from specroll.engine.spec.drafts import propose_drafts, propose_trees
from specroll.engine.spec.proposer import Proposer
from specroll.engine.spec.stats import SpeculativeStats
from specroll.engine.spec.tree import DraftTree, TreeShape, verify_trees
from specroll.engine.spec.verify import verify_drafts

Emitted = tuple[list[int], list[float], int]
"""One sampling sequence's step: emitted token ids, their behavior logprobs, drafts accepted."""


@dataclass(frozen=True)
class SpecContext:
    """What the modes use of the engine: the proposer, the target and its K/V pages."""

    proposer: Proposer | None
    runner: ModelRunner
    """The target (its LM head, for the tree walk) and its K/V cache (to move a tree's kept path)."""
    block_manager: BlockManager
    """The pages, to release those of rejected drafts."""
    gpu_sampler: FlashInferSampler | None
    """FlashInfer's sampling and chain verification on CUDA; ``None``: the torch reference."""

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len


@dataclass(frozen=True)
class StepDrafts:
    """A step's drafts, keyed by the sequences that carry some (none: plain decoding)."""

    tokens: dict[Sequence, list[int]] = field(default_factory=dict)
    """Draft token ids the runner appends after each sequence's new token: a chain, or a tree's
    nodes in node order."""
    probs: dict[Sequence, torch.Tensor] = field(default_factory=dict)
    """float32 ``[len(chain), V]``: the q a sampled chain was drawn from (absent: one-hot q)."""
    trees: dict[Sequence, DraftTree] = field(default_factory=dict)
    """The tree each sequence's drafts form, on a tree step."""

    @property
    def defers_lm_head(self) -> bool:
        """The forward returns final hidden states, not logits: the tree walk runs the LM head
        only on the rows it reaches (on a CPU most of a tree's cost is that head)."""
        return bool(self.trees)


@dataclass(frozen=True)
class Verified:
    """What a step's verification produced."""

    emitted: list[Emitted]
    """Per sampling sequence, in batch order."""
    paths: dict[Sequence, list[int]] | None = None
    """On a tree step: each tree sequence's accepted nodes (whose features the proposer is handed)."""


class Speculation(Protocol):
    """One step's speculation mode (module docstring)."""

    @property
    def k(self) -> int:
        """The step's draft length (a tree's depth), reported as ``SpeculativeStats.k``."""
        ...

    @property
    def lookahead(self) -> int:
        """K/V slots per sampling sequence past its last token, reserved by the scheduler."""
        ...

    def propose(self, scheduled: list[ScheduledSequence]) -> StepDrafts:
        """The drafts of the sequences that decode this step, trimmed to what verification trusts."""
        ...

    def verify(
        self, output: torch.Tensor, samplers: list[Sequence], drafts: StepDrafts, stats: SpeculativeStats
    ) -> Verified:
        """Emit each sampling sequence's tokens from the target's ``output`` rows (logits ``[rows, V]``,
        or hidden states ``[rows, hidden_size]`` when ``drafts.defers_lm_head``), roll back the K/V
        of rejected drafts and count them in ``stats``. ``samplers`` is never empty: a step that
        samples nothing does not verify."""
        ...


@dataclass(frozen=True)
class PlainDecoding:
    """k = 0: no drafts; one token sampled per sampling sequence."""

    ctx: SpecContext
    k: int = 0
    lookahead: int = 0

    def propose(self, scheduled: list[ScheduledSequence]) -> StepDrafts:
        return StepDrafts()

    def verify(
        self, output: torch.Tensor, samplers: list[Sequence], drafts: StepDrafts, stats: SpeculativeStats
    ) -> Verified:
        params = [s.sampling for s in samplers]
        gpu = self.ctx.gpu_sampler
        if gpu is None:
            tokens, logprobs = sample(output, params, [s.generator for s in samplers])
        else:
            tokens, logprobs = gpu.sample(output, params)
        return Verified([([t], [lp], 0) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)])


@dataclass(frozen=True)
class ChainDrafts:
    """Up to k drafts per decoding sequence in a chain, verified by chain rejection sampling."""

    ctx: SpecContext
    k: int

    @property
    def lookahead(self) -> int:
        return self.k

    def propose(self, scheduled: list[ScheduledSequence]) -> StepDrafts:
        assert self.ctx.proposer is not None  # k > 0 only with a proposer
        tokens, probs = propose_drafts(self.ctx.proposer, scheduled, self.k, self.ctx.vocab_size, self.ctx.page_size)
        return StepDrafts(tokens, probs)

    def verify(
        self, output: torch.Tensor, samplers: list[Sequence], drafts: StepDrafts, stats: SpeculativeStats
    ) -> Verified:
        return _verify_chains(self.ctx, output, samplers, drafts, self.k, stats)


@dataclass(frozen=True)
class TreeDrafts:
    """A draft tree of ``shape`` per decoding sequence, verified by the tree walk (``tree.py``)."""

    ctx: SpecContext
    shape: TreeShape

    @property
    def k(self) -> int:
        return self.shape.depth

    @property
    def lookahead(self) -> int:
        return self.shape.nodes

    def propose(self, scheduled: list[ScheduledSequence]) -> StepDrafts:
        assert self.ctx.proposer is not None  # a tree is chosen only with a proposer
        ctx = self.ctx
        trees = propose_trees(ctx.proposer, scheduled, self.shape, ctx.vocab_size, ctx.page_size, ctx.max_model_len)
        return StepDrafts({seq: tree.tokens for seq, tree in trees.items()}, trees=trees)

    def verify(
        self, output: torch.Tensor, samplers: list[Sequence], drafts: StepDrafts, stats: SpeculativeStats
    ) -> Verified:
        """Walk each sampling sequence's tree over the final hidden states ``output`` of its rows,
        keep the accepted path's K/V (moved to the slots of its positions) and roll back the rest."""
        if not drafts.trees:  # no sequence drafted a tree: logits came back, verified as chains without drafts
            return _verify_chains(self.ctx, output, samplers, drafts, self.k, stats)
        hidden = output  # [rows, hidden_size]
        model, runner = self.ctx.runner.model, self.ctx.runner
        seq_trees = [drafts.trees.get(seq, DraftTree([], [])) for seq in samplers]
        verdicts = verify_trees(lambda rows: model.compute_logits(hidden.index_select(0, rows.to(hidden.device))),
                                samplers, seq_trees, num_rows=hidden.shape[0])
        paths = {}
        for seq, tree, verdict in zip(samplers, seq_trees, verdicts, strict=True):
            if not len(tree):
                continue
            root = seq.num_computed_tokens - len(tree) - 1  # the slot of the last token before the step
            runner.keep_tree_path(seq, root, verdict.path)
            seq.num_computed_tokens -= len(tree) - len(verdict.path)
            self.ctx.block_manager.truncate(seq, seq.num_computed_tokens)
            stats.count_verify(len(tree), len(verdict.path))
            paths[seq] = verdict.path
        return Verified([(v.token_ids, v.logprobs, len(v.path)) for v in verdicts], paths)


def speculation_for(arm: Arm, ctx: SpecContext) -> Speculation:
    """The mode that runs a step whose arm is ``arm``: 0 plain decoding, k > 0 a chain, a tree shape a tree."""
    if isinstance(arm, TreeShape):
        return TreeDrafts(ctx, arm)
    return ChainDrafts(ctx, arm) if arm else PlainDecoding(ctx)


def _verify_chains(
    ctx: SpecContext, logits: torch.Tensor, samplers: list[Sequence], drafts: StepDrafts, k: int,
    stats: SpeculativeStats,
) -> Verified:
    """Verify each sampling sequence's chain (``verify.py``; FlashInfer's on CUDA), roll back the K/V
    of the rejected drafts and count them in ``stats``."""
    seq_drafts = [drafts.tokens.get(seq, []) for seq in samplers]
    seq_probs = [drafts.probs.get(seq) for seq in samplers]
    verify = verify_drafts if ctx.gpu_sampler is None else ctx.gpu_sampler.verify
    emitted = verify(logits, samplers, seq_drafts, seq_probs, k)
    for seq, d, (_, _, accepted) in zip(samplers, seq_drafts, emitted, strict=True):
        # Roll back the K/V of rejected drafts: only [last, d_1..d_accepted] stay valid.
        seq.num_computed_tokens -= len(d) - accepted
        ctx.block_manager.truncate(seq, seq.num_computed_tokens)
        stats.count_verify(len(d), accepted)
    return Verified(emitted)
