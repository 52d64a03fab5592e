"""Speculative decoding inside the engine: a proposer drafts, the target verifies, a prefix is accepted.

One step drafts up to k tokens per decoding sequence — a chain, or a tree with several candidates
where the drafter is unsure — scores them in the same target forward as the rest of the batch,
accepts a prefix (of the chain, or a path of the tree) by rejection sampling and emits one more
token (recovered at the first rejection, or the bonus token when every draft passes). The output
is distributed exactly as the target's (Leviathan et al. 2023; Chen et al. 2023; SpecInfer for trees).

Which file holds what:

- ``modes.py``: one class per mode of a step — :class:`PlainDecoding`, :class:`ChainDrafts`,
  :class:`TreeDrafts` — behind the :class:`Speculation` interface the engine's step calls
  (``lookahead``, ``propose``, ``verify``), with :class:`StepDrafts` (a step's drafts) and
  :class:`Verified` (its emitted tokens); :func:`speculation_for` maps a step's arm to its mode.
- ``draft_length.py``: which speculation each step runs: :class:`SpeculationPolicy` (fixed k, a
  fixed tree, or adaptive) over :class:`DraftLengthBandit`, the adaptive controller choosing k or
  a tree shape per step.
- ``proposer.py``: the :class:`Proposer` protocol a drafter (``specroll.drafter``) implements
  (:class:`TreeProposer` for one that also drafts trees) and its data types: :class:`DraftInput`
  (a sequence to draft for), :class:`Proposal` (its drafts and q), :class:`FeatureUpdate` (target
  features handed back); and :func:`draft_cap`, the most drafts a sequence may take without
  passing its length limit.
- ``drafts.py``: a step's drafts, asked of the proposer and trimmed to what verification can trust
  (:func:`propose_drafts`, :func:`propose_trees`, :func:`valid_drafts`), and the target features of
  the newly verified positions fed back to it (:func:`observe_features`).
- ``verify.py``: chain verification: :func:`verify_drafts` (target logits → emitted tokens and
  behavior logprobs) over :func:`chain_rejection_sample` (the accept/recover/bonus rule).
- ``tree.py``: draft trees: :class:`TreeShape` (how large a tree may grow), :class:`DraftTree`,
  their trimming (:func:`valid_tree`, :func:`cap_tree`) and the lossless tree walk
  (:func:`verify_trees`).
- ``stats.py``: :class:`SpeculativeStats`, drafted/accepted counts and acceptance length.

The CUDA verifier (FlashInfer's ``chain_speculative_sampling``) stays with the FlashInfer backend in
``engine/flashinfer_sampling.py``; ``modes.py`` calls it when the engine has its GPU sampler.
"""
