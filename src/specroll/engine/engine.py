"""The generation engine: schedule → propose → run → verify/sample → emit, one step at a time.

Synchronous and seedable, with no I/O of its own; the generator actor drives it from a worker
thread. A step is one ragged batch (prefill chunks and decodes together) over the paged KV cache.
The scheduler picks the batch (``scheduler.py``), the proposer drafts for its decodes
(``spec/drafts.py``), the model runner runs the target over it (``model_runner.py``), the drafts are
verified (``spec/verify.py``) or a token is sampled (``sampler.py``), and the tokens are emitted
here. The device and dtype checks are in ``device.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf

import torch

from specroll.engine.attention import AttentionBackend, flashinfer_problem
from specroll.engine.block_manager import BlockManager
from specroll.engine.config import EngineConfig
from specroll.engine.device import check_device, resolve_dtype
from specroll.engine.flashinfer_attention import FlashInferAttention
from specroll.engine.flashinfer_sampling import FlashInferSampler
from specroll.engine.loaders.checkpoint import Checkpoint, load_checkpoint
from specroll.engine.model import CausalLM
from specroll.engine.model_runner import ModelRunner
from specroll.engine.phases import PhaseClock
from specroll.engine.sampler import sample
from specroll.engine.scheduler import ScheduledSequence, Scheduler
from specroll.engine.sequence import Completion, Sequence, SequenceStatus, StepOutput
from specroll.engine.spec.draft_length import Arm, DraftLengthBandit
from specroll.engine.spec.drafts import observe_features, propose_drafts, propose_trees
from specroll.engine.spec.proposer import Proposer, drafts_trees
from specroll.engine.spec.stats import SpeculativeStats
from specroll.engine.spec.tree import DraftTree, TreeShape, verify_trees
from specroll.engine.spec.verify import verify_drafts
from specroll.protocol.messages import FinishReason
from specroll.protocol.sampling import SamplingParams


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
        ValueError: the KV-cache memory holds too few pages to serve one full-length request, or the
            proposer taps a layer the model does not have.
    """

    def __init__(
        self, config: EngineConfig, checkpoint: Checkpoint | None = None, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = check_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.backend == "flashinfer":  # fail before spending time loading the model
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
        self._gpu_sampler = (
            FlashInferSampler(self.device, config.seed) if isinstance(self.backend, FlashInferAttention) else None
        )
        self.eos_token_ids = frozenset(ckpt.tokenizer.eos_token_ids) | frozenset(ckpt.config.eos_token_ids)
        self.weight_version = 0
        self._requests: dict[str, Sequence] = {}
        self.spec_stats = SpeculativeStats()
        """Speculative-decoding counters summed over every step so far."""
        self.last_step_stats = SpeculativeStats()
        """The last step's counters (k chosen, drafted, accepted, draft and verify time)."""
        self._bandit: DraftLengthBandit | None = None
        self._tree: TreeShape | None = None
        self.proposer: Proposer | None = None
        if proposer is not None:
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
            ValueError: the proposer taps a layer the model does not have (likewise).
        """
        if proposer is not None:
            proposer.attach(self.model)  # a drafter checks it fits this model first, naming its file
            layers = self.model_config.num_layers
            bad = [i for i in proposer.feature_layers if not 0 <= i <= layers]
            if bad:
                raise ValueError(f"the proposer taps layers {bad}; the model has {layers} layers, "
                                 f"expected taps in [0, {layers}]")
        if self.proposer is not None:
            for request_id in self._requests:
                self.proposer.finish(request_id)
        self.proposer = proposer
        self.runner.feature_layers = tuple(proposer.feature_layers) if proposer is not None else ()
        if self.runner.feature_layers:
            self.block_manager.forget_cached()
        self._bandit = None
        trees = self.config.tree_shapes if proposer is not None and drafts_trees(proposer) else ()
        if proposer is not None and self.config.draft_length == "adaptive":
            self._bandit = DraftLengthBandit(self.config.num_draft_tokens, trees=trees, seed=self.config.seed)
        self._tree = None
        if proposer is not None and self.config.draft_length == "tree":
            if not trees:
                raise ValueError(f"draft_length='tree' needs a proposer that drafts trees; "
                                 f"{type(proposer).__name__} drafts chains only")
            self._tree = trees[0]

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
        are verified losslessly (``spec/verify.py``); K/V slots of rejected drafts are rolled back.
        """
        start_time = time.perf_counter()
        clock = self.phases
        clock.start()
        arm = self._choose_speculation()
        tree_shape = arm if isinstance(arm, TreeShape) else None
        k = tree_shape.depth if tree_shape is not None else int(arm)
        scheduled = self.scheduler.schedule(self.weight_version, lookahead=tree_shape.nodes if tree_shape else k)
        if not scheduled:
            return []
        clock.mark("schedule")
        stats = SpeculativeStats(num_steps=1, k=k)
        trees: dict[Sequence, DraftTree] | None = None
        if tree_shape is not None:
            assert self.proposer is not None  # a tree is chosen only with a proposer
            trees = propose_trees(self.proposer, scheduled, tree_shape, self.model_config.vocab_size,
                                  self.config.page_size, self.max_model_len)
            drafts, draft_probs = {seq: tree.tokens for seq, tree in trees.items()}, {}
        else:
            drafts, draft_probs = self._propose(scheduled, k)
        clock.mark("propose")
        stats.draft_time_s = time.perf_counter() - start_time
        starts = [s.seq.num_computed_tokens for s in scheduled]
        inputs = self.runner.prepare(scheduled, drafts, trees)
        clock.mark("metadata")
        # logits [rows, V]: 1 + drafts per sampling sequence, where the sampler reads them
        # a tree step's LM head runs in the verification, on the rows the walk reaches
        logits, features = self.runner.forward(inputs, to_cpu=self._gpu_sampler is None, hidden_only=bool(trees))
        clock.mark("forward")
        for s in scheduled:  # the forward wrote their K/V; rejected drafts are rolled back in _verify
            s.seq.num_computed_tokens += s.num_new_tokens + len(drafts.get(s.seq, ()))
        samplers = [s.seq for s in scheduled if s.samples]
        paths: dict[Sequence, list[int]] | None = None
        if not samplers:  # only prefill chunks that stop short of their last token: nothing to sample or verify
            emitted = []
        elif trees:
            emitted, paths = self._verify_trees(logits, samplers, trees, stats)
        elif k:
            emitted = self._verify(logits, samplers, drafts, draft_probs, k, stats)
        else:
            emitted = self._sample(logits, samplers)
        clock.mark("sample")
        stats.verify_time_s = time.perf_counter() - start_time - stats.draft_time_s
        outputs = self._emit(scheduled, samplers, emitted)
        if features is not None:
            assert self.proposer is not None  # features are tapped only for a proposer
            observe_features(self.proposer, scheduled, drafts, starts, features, paths)
        stats.num_emitted = sum(len(out.new_token_ids) for out in outputs)
        self._record_step(scheduled, arm, stats, time.perf_counter() - start_time)
        clock.mark("emit")
        clock.end_step()
        return outputs

    def _choose_speculation(self) -> Arm:
        """This step's speculation: none without a proposer, the fixed k or tree, or the bandit's
        pick for the live decode batch size."""
        if self.proposer is None:
            return 0
        if self._bandit is None or not self.scheduler.running:
            return self._tree if self._tree is not None else self.config.num_draft_tokens
        return self._bandit.choose(len(self.scheduler.running))

    def _propose(
        self, scheduled: list[ScheduledSequence], k: int
    ) -> tuple[dict[Sequence, list[int]], dict[Sequence, torch.Tensor]]:
        """The drafts (and their q, when sampled) of the sequences that decode this step; none at k = 0."""
        if not k:
            return {}, {}
        assert self.proposer is not None  # k > 0 only with a proposer
        return propose_drafts(self.proposer, scheduled, k, self.model_config.vocab_size, self.config.page_size)

    def _verify(
        self, logits: torch.Tensor, samplers: list[Sequence], drafts: dict[Sequence, list[int]],
        draft_probs: dict[Sequence, torch.Tensor], k: int, stats: SpeculativeStats,
    ) -> list[tuple[list[int], list[float], int]]:
        """Verify each sampling sequence's drafts, roll back the K/V of the rejected ones and count
        them in ``stats``; per sequence ``(tokens, behavior logprobs, drafts accepted)``."""
        seq_drafts = [drafts.get(seq, []) for seq in samplers]
        seq_probs = [draft_probs.get(seq) for seq in samplers]
        verify = verify_drafts if self._gpu_sampler is None else self._gpu_sampler.verify
        emitted = verify(logits, samplers, seq_drafts, seq_probs, k)
        for seq, d, (_, _, accepted) in zip(samplers, seq_drafts, emitted, strict=True):
            # Roll back the K/V of rejected drafts: only [last, d_1..d_accepted] stay valid.
            seq.num_computed_tokens -= len(d) - accepted
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            stats.count_verify(len(d), accepted)
        return emitted

    def _verify_trees(
        self, hidden: torch.Tensor, samplers: list[Sequence], trees: dict[Sequence, DraftTree],
        stats: SpeculativeStats,
    ) -> tuple[list[tuple[list[int], list[float], int]], dict[Sequence, list[int]]]:
        """Walk each sampling sequence's draft tree (``spec/tree.py``) over the final hidden states
        ``hidden`` of its rows (the LM head runs on the rows the walk reaches), keep the accepted path's K/V
        (moved to the slots of its positions) and roll back the rest; per sequence ``(tokens,
        behavior logprobs, drafts accepted)``, and each tree sequence's accepted nodes."""
        seq_trees = [trees.get(seq, DraftTree([], [])) for seq in samplers]
        model = self.model
        verdicts = verify_trees(lambda rows: model.compute_logits(hidden.index_select(0, rows.to(hidden.device))),
                                samplers, seq_trees, num_rows=hidden.shape[0])
        paths = {}
        for seq, tree, verdict in zip(samplers, seq_trees, verdicts, strict=True):
            if not len(tree):
                continue
            root = seq.num_computed_tokens - len(tree) - 1  # the slot of the last token before the step
            self.runner.keep_tree_path(seq, root, verdict.path)
            seq.num_computed_tokens -= len(tree) - len(verdict.path)
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            stats.count_verify(len(tree), len(verdict.path))
            paths[seq] = verdict.path
        return [(v.token_ids, v.logprobs, len(v.path)) for v in verdicts], paths

    def _sample(self, logits: torch.Tensor, samplers: list[Sequence]) -> list[tuple[list[int], list[float], int]]:
        """One token per sampling sequence (plain decoding), in :meth:`_verify`'s form."""
        params = [s.sampling for s in samplers]
        if self._gpu_sampler is None:
            tokens, logprobs = sample(logits, params, [s.generator for s in samplers])
        else:
            tokens, logprobs = self._gpu_sampler.sample(logits, params)
        return [([t], [lp], 0) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)]

    def _emit(
        self, scheduled: list[ScheduledSequence], samplers: list[Sequence],
        emitted: list[tuple[list[int], list[float], int]],
    ) -> list[StepOutput]:
        """Key the pages a prefill chunk completed, append each sampling sequence's tokens, report."""
        for s in scheduled:
            if not s.samples:  # a prefill chunk; sampling sequences are keyed in _emit_tokens, tokens appended
                self.block_manager.cache_full_pages(s.seq, self.weight_version)
        return [self._emit_tokens(seq, tokens, lps) for seq, (tokens, lps, _) in zip(samplers, emitted, strict=True)]

    def _record_step(
        self, scheduled: list[ScheduledSequence], arm: Arm, stats: SpeculativeStats, seconds: float
    ) -> None:
        self.last_step_stats = stats
        self.spec_stats.add(stats)
        # Only pure decode steps measure a speculation: a prefill chunk's cost says nothing about it.
        if self._bandit is not None and all(s.num_new_tokens == 1 for s in scheduled):
            self._bandit.record(arm, stats.num_emitted, seconds)

    def _emit_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> StepOutput:
        """Append tokens in order until one finishes the request; report the delta."""
        finish: FinishReason | None = None
        kept = 0
        for token, logprob in zip(tokens, logprobs, strict=True):
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.weight_version)
            kept += 1
            finish = seq.stop_reason(token, self.eos_token_ids)
            if finish is not None:
                break
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
