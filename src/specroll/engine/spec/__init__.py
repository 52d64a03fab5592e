"""Speculative decoding inside the engine: a proposer drafts, the target verifies, a prefix is accepted.

One step drafts up to k tokens per decoding sequence, scores ``[last, d1..dk]`` in the same target
forward as the rest of the batch, accepts a prefix of the drafts by chain rejection sampling and
emits one more token (recovered at the first rejection, or the bonus token when every draft passes).
The output is distributed exactly as the target's (Leviathan et al. 2023; Chen et al. 2023).

Which file holds what:

- ``proposer.py``: the :class:`Proposer` protocol a drafter (``specroll.drafter``) implements and its
  data types: :class:`DraftInput` (a sequence to draft for), :class:`Proposal` (its drafts and q),
  :class:`FeatureUpdate` (target features handed back); and :func:`draft_cap`, the most drafts a
  sequence may take without passing its length limit.
- ``drafts.py``: a step's drafts, asked of the proposer and trimmed to what verification can trust
  (:func:`propose_drafts`, :func:`valid_drafts`), and the target features of the newly verified
  positions fed back to it (:func:`observe_features`).
- ``verify.py``: verification: :func:`verify_drafts` (target logits → emitted tokens and behavior
  logprobs) over :func:`chain_rejection_sample` (the accept/recover/bonus rule).
- ``draft_length.py``: the adaptive controller choosing k per step (:class:`DraftLengthBandit`).
- ``stats.py``: :class:`SpeculativeStats`, drafted/accepted counts and acceptance length.

The CUDA verifier (FlashInfer's ``chain_speculative_sampling``) stays with the FlashInfer backend in
``engine/flashinfer_sampling.py``.
"""
