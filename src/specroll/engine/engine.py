"""The generation engine: schedule → propose → run → verify/sample → emit, one step at a time.

Synchronous and seedable, with no I/O of its own; the generator actor drives it from a worker
thread. A step is one ragged batch (prefill chunks and decodes together) over the paged KV cache.
The scheduler picks the batch (``scheduler.py``); the step's speculation (``spec/modes.py``: plain
decoding, chain drafts or tree drafts, chosen by ``spec/draft_length.py``) reserves its drafts' K/V
slots, drafts for the decodes and, after the model runner has run the target over the batch
(``model_runner.py``), verifies the drafts or samples a token; the tokens are emitted here. The
model comes from ``loaders/``; the device and dtype checks are in ``device.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from specroll.engine.attention import AttentionBackend, flashinfer_problem
from specroll.engine.block_manager import BlockManager
from specroll.engine.compiled_step import usable_cache_dir
from specroll.engine.config import EngineConfig
from specroll.engine.device import check_device, resolve_dtype
from specroll.engine.flashinfer_attention import FlashInferAttention
from specroll.engine.flashinfer_sampling import FlashInferSampler
from specroll.engine.loaders.checkpoint import Checkpoint, load_checkpoint
from specroll.engine.model import CausalLM
from specroll.engine.model_runner import ModelRunner
from specroll.engine.phases import PhaseClock
from specroll.engine.scheduler import ScheduledSequence, Scheduler
from specroll.engine.sequence import Completion, Sequence, SequenceStatus, StepOutput
from specroll.engine.spec.draft_length import Arm, SpeculationPolicy
from specroll.engine.spec.drafts import observe_features
from specroll.engine.spec.modes import SpecContext, Speculation, StepDrafts, Verified, speculation_for
from specroll.engine.spec.proposer import Proposer
from specroll.engine.spec.stats import SpeculativeStats
from specroll.protocol.messages import FinishReason
from specroll.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class _Step:
    """One step in flight: its speculation and batch, and what was true of the batch when scheduled."""

    started: float
    """``time.perf_counter()`` at the step's start."""
    arm: Arm
    spec: Speculation
    scheduled: list[ScheduledSequence]
    stats: SpeculativeStats
    """The step's counters, filled in as it runs."""
    starts: list[int]
    """Each scheduled sequence's computed tokens before the step."""
    samplers: list[Sequence]
    """The sequences the step samples a token for (it reaches their last token)."""


class Engine:
    """Continuous-batching generation over a paged KV cache.

    Args:
        config: engine settings; the model is loaded from ``config.model``.
        checkpoint: an already loaded checkpoint to use instead of loading ``config.model``.
        proposer: a drafter (``specroll.drafter``) for speculative decoding; ``None`` decodes one
            token per step. Each step drafts ``config.num_draft_tokens`` tokens per decoding
            sequence, or, with ``config.draft_length="adaptive"``, a length in ``[0, K]`` chosen
            online (``spec/draft_length.py``).

    Raises:
        CheckpointError: the model cannot be loaded.
        ValueError: the KV-cache memory holds too few pages to serve one full-length request, the
            proposer taps a layer the model does not have, or ``draft_length="tree"`` with a
            proposer that drafts chains only.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None, proposer: Proposer | None = None):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = check_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.compile == "on":  # fail before spending time loading the model (as for flashinfer below)
            usable_cache_dir(config.compile_cache_dir)
        if config.backend == "flashinfer":
            problem = flashinfer_problem(self.device, self.dtype, head_dim=None)
            if problem is not None:
                raise ValueError(f"attention backend 'flashinfer' {problem}")
        ckpt = checkpoint if checkpoint is not None else load_checkpoint(config.model, dtype=self.dtype)
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.runner = ModelRunner(config, ckpt, self.device, self.dtype)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # With FlashInfer attention, sampling and verification run on the GPU through FlashInfer too.
        flashinfer = isinstance(self.backend, FlashInferAttention)
        self._gpu_sampler = FlashInferSampler(self.device, config.seed) if flashinfer else None
        self.eos_token_ids = frozenset(ckpt.tokenizer.eos_token_ids) | frozenset(ckpt.config.eos_token_ids)
        self.weight_version = 0
        self._requests: dict[str, Sequence] = {}
        self.spec_stats = SpeculativeStats()
        """Speculative-decoding counters summed over every step so far."""
        self.last_step_stats = SpeculativeStats()
        """The last step's counters (k chosen, drafted, accepted, draft and verify time)."""
        self.proposer: Proposer | None = None
        self._policy: SpeculationPolicy
        """Which speculation each step runs (``spec/draft_length.py``); made by :meth:`set_proposer`."""
        self.set_proposer(proposer)
        self._arrivals = itertools.count()
        self.phases = PhaseClock(self.device)
        """Per-phase step timing (``phases.py``); off until ``phases.enabled = True``."""

    @property
    def model(self) -> CausalLM:
        """The target model (the runner's)."""
        return self.runner.model

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per layer ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (the runner's)."""
        return self.runner.kv_caches

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend (the runner's)."""
        return self.runner.backend

    def set_proposer(self, proposer: Proposer | None) -> None:
        """Draft with ``proposer`` from the next step on (``None``: plain decoding); between steps only.

        The proposer is checked against the model before anything changes. Live requests keep
        decoding; a learned drafter sees only their positions computed from now on, so it drafts
        for them only if it can recover their earlier features — output stays lossless either way.
        A proposer that taps features starts the prefix cache afresh: it never saw the features of
        the cached pages, and a request that took them from the cache could never be drafted.

        Raises:
            DrafterError: a drafter made for another target (the engine keeps its proposer).
            ValueError: the proposer taps a layer the model does not have, or ``draft_length="tree"``
                and it drafts chains only (likewise).
        """
        if proposer is not None:
            proposer.attach(self.model)  # a drafter checks it fits this model first, naming its file
            layers = self.model_config.num_layers
            bad = [i for i in proposer.feature_layers if not 0 <= i <= layers]
            if bad:
                raise ValueError(f"the proposer taps layers {bad}; the model has {layers} layers, "
                                 f"expected taps in [0, {layers}]")
        config = self.config
        policy = SpeculationPolicy(proposer, draft_length=config.draft_length, max_k=config.num_draft_tokens,
                                   tree_shapes=config.tree_shapes, seed=config.seed)
        if self.proposer is not None:
            for request_id in self._requests:
                self.proposer.finish(request_id)
        self.proposer = proposer
        self.runner.feature_layers = tuple(proposer.feature_layers) if proposer is not None else ()
        if self.runner.feature_layers:
            self.block_manager.forget_cached()
        self._policy = policy

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: SequenceOf[int],
        sampling: SamplingParams,
        request_id: str,
        group_id: str | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next step.

        Args:
            prompt_token_ids: the prompt, already tokenized (chat template applied).
            sampling: how to sample and when to stop.
            request_id: unique among live requests.
            group_id: requests sharing it (the n samples of one prompt) share prompt pages.

        Raises:
            ValueError: duplicate ``request_id``, empty prompt, out-of-vocabulary token ids, or a
                prompt that leaves no room in the context for one response token.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already live")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: empty prompt, expected at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt has {len(prompt)} tokens, the context holds "
                f"{self.max_model_len}; expected at most {self.max_model_len - 1}"
            )
        arrival = next(self._arrivals)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator()
            seed = sampling.seed if sampling.seed is not None else hash((self.config.seed, arrival)) & (2**63 - 1)
            generator.manual_seed(seed)
        seq = Sequence(request_id=request_id, group_id=group_id, prompt_len=len(prompt), token_ids=prompt,
                       sampling=sampling, generator=generator, arrival=arrival,
                       max_len=min(self.max_model_len, len(prompt) + sampling.max_tokens))
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> Completion:
        """Stop a request in any state and return every token it produced so far.

        Raises:
            KeyError: no live request has this id.
        """
        seq = self._live(request_id)
        self._retire(seq, "abort")
        return Completion.of(seq)

    def _live(self, request_id: str) -> Sequence:
        seq = self._requests.get(request_id)
        if seq is None:
            raise KeyError(f"no live request {request_id!r}")
        return seq

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish ``seq``: free its pages, drop it from the queues and the proposer's state."""
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self._requests[seq.request_id]
        if self.proposer is not None:
            self.proposer.finish(seq.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def prompt_token_ids(self, request_id: str) -> list[int]:
        """The prompt of a live request.

        Raises:
            KeyError: no live request has this id.
        """
        seq = self._live(request_id)
        return seq.token_ids[: seq.prompt_len]

    def output_so_far(self, request_id: str) -> tuple[list[int], list[float], list[int]]:
        """Response token ids, behavior logprobs and policy versions a live request has so far.

        Raises:
            KeyError: no live request has this id.
        """
        seq = self._live(request_id)
        return seq.output_token_ids, list(seq.logprobs), list(seq.versions)

    def live_request_ids(self) -> list[str]:
        """Ids of every request not yet finished or aborted, in arrival order."""
        return list(self._requests)

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one batch and return a delta for every request that produced a token or finished.

        With a proposer, each decoding sequence's drafts ride along in the same forward pass and
        are verified losslessly (``spec/modes.py``); K/V slots of rejected drafts are rolled back.
        """
        step = self._schedule()
        if step is None:  # nothing can run
            return []
        drafts = self._propose(step)
        output, features = self._forward(step, drafts)
        verified = self._verify(step, drafts, output)
        outputs = self._emit(step, verified)
        self._observe(step, drafts, features, verified)
        self._count(step, outputs)
        return outputs

    def _choose_speculation(self) -> Arm:
        """This step's speculation (``spec/draft_length.py``): none without a proposer, the fixed k
        or tree, or the bandit's pick for the live decode batch size."""
        return self._policy.choose(len(self.scheduler.running))

    def _schedule(self) -> _Step | None:
        """Choose the step's speculation and its batch, with K/V slots for the drafts; ``None``
        when nothing can run."""
        started = time.perf_counter()
        self.phases.start()
        arm = self._choose_speculation()
        spec = speculation_for(arm, SpecContext(self.proposer, self.runner, self.block_manager, self._gpu_sampler))
        scheduled = self.scheduler.schedule(self.weight_version, lookahead=spec.lookahead)
        if not scheduled:
            return None
        self.phases.mark("schedule")
        return _Step(started, arm, spec, scheduled, SpeculativeStats(num_steps=1, k=spec.k),
                     [s.seq.num_computed_tokens for s in scheduled], [s.seq for s in scheduled if s.samples])

    def _propose(self, step: _Step) -> StepDrafts:
        """The drafts of the sequences that decode this step (none when the step does not draft)."""
        drafts = step.spec.propose(step.scheduled)
        self.phases.mark("propose")
        step.stats.draft_time_s = time.perf_counter() - step.started
        return drafts

    def _forward(self, step: _Step, drafts: StepDrafts) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the target over the batch, drafts included, and advance every sequence past the K/V
        it wrote. Returns float32 logits ``[rows, V]`` (1 + drafts per sampling sequence, where the
        sampler reads them) — a tree step's final hidden states instead, the LM head then running
        in the verification on the rows the walk reaches — and the proposer's features or None."""
        inputs = self.runner.prepare(step.scheduled, drafts.tokens, drafts.trees)
        self.phases.mark("metadata")
        output, features = self.runner.forward(inputs, to_cpu=self._gpu_sampler is None,
                                               hidden_only=drafts.defers_lm_head)
        self.phases.mark("forward")
        for s in step.scheduled:  # the forward wrote their K/V; the verification rolls rejected drafts back
            s.seq.num_computed_tokens += s.num_new_tokens + len(drafts.tokens.get(s.seq, ()))
        return output, features

    def _verify(self, step: _Step, drafts: StepDrafts, output: torch.Tensor) -> Verified:
        """Each sampling sequence's tokens: its drafts verified, or one token sampled."""
        if step.samplers:
            verified = step.spec.verify(output, step.samplers, drafts, step.stats)
        else:  # only prefill chunks that stop short of their last token: nothing to sample or verify
            verified = Verified([])
        self.phases.mark("sample")
        step.stats.verify_time_s = time.perf_counter() - step.started - step.stats.draft_time_s
        return verified

    def _emit(self, step: _Step, verified: Verified) -> list[StepOutput]:
        """Key the pages a prefill chunk completed, append each sampling sequence's tokens, report."""
        for s in step.scheduled:
            if not s.samples:  # a prefill chunk; sampling sequences are keyed in _emit_tokens, tokens appended
                self.block_manager.cache_full_pages(s.seq, self.weight_version)
        return [self._emit_tokens(seq, tokens, lps)
                for seq, (tokens, lps, _) in zip(step.samplers, verified.emitted, strict=True)]

    def _observe(
        self, step: _Step, drafts: StepDrafts, features: torch.Tensor | None, verified: Verified
    ) -> None:
        """Hand the proposer the features of the positions the step made valid (when it taps some)."""
        if features is not None:
            assert self.proposer is not None  # features are tapped only for a proposer
            observe_features(self.proposer, step.scheduled, drafts.tokens, step.starts, features, verified.paths)

    def _count(self, step: _Step, outputs: list[StepOutput]) -> None:
        """Fold the step into the counters, the adaptive controller and the phase clock."""
        stats = step.stats
        stats.num_emitted = sum(len(out.new_token_ids) for out in outputs)
        self.last_step_stats = stats
        self.spec_stats.add(stats)
        self._policy.record(step.arm, step.scheduled, stats.num_emitted, time.perf_counter() - step.started)
        self.phases.mark("emit")
        self.phases.end_step()

    def _emit_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> StepOutput:
        """Append tokens in order until one finishes the request; report the delta."""
        kept, finish = seq.append_tokens(tokens, logprobs, self.weight_version, self.eos_token_ids)
        # Key the pages whose K/V is now complete: accepted drafts are in token_ids only from here.
        self.block_manager.cache_full_pages(seq, self.weight_version)
        if finish is not None:
            self._retire(seq, finish)
        return StepOutput(seq.request_id, seq.group_id, tokens[:kept], logprobs[:kept],
                          [self.weight_version] * kept, finish is not None, finish, seq.num_output_tokens)

    # ---- weights --------------------------------------------------------------------------

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Replace some or all policy weights between steps and tag later tokens with ``version``.

        Every tensor is validated before any is copied, so a bad update changes nothing. Floating
        tensors of any dtype are accepted and cast to the engine's dtype (bf16 on the wire).
        Running requests keep their K/V (computed under older weights); their pages are no longer
        shared through the prefix cache.

        Args:
            named_tensors: Hugging Face parameter names → tensors of the checkpoint's shapes (a
                mapping, or ``(name, tensor)`` pairs such as ``model.named_parameters()``).
            version: the new policy version; must be greater than the served one.

        Raises:
            ValueError: unknown name, wrong shape, non-floating dtype, or a version not above the
                current one. The message names the offending tensor or value.
        """
        named_tensors = dict(named_tensors)
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the served version {self.weight_version}")
        self.runner.load_weights(named_tensors)  # validates every tensor before it copies any
        self.weight_version = version
        if self.proposer is not None:
            self.proposer.attach(self.model)  # a drafter sharing the LM head re-reads it
        for seq in self._requests.values():
            if seq.num_computed_tokens:
                seq.prefix_cacheable = False
