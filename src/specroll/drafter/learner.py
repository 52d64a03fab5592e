"""The drafter learner: an EAGLE head trained step by step on recent rollouts of a moving target.

Pure and synchronous (no I/O, no threads): the online drafter-trainer actor
(``specroll.actors.drafter_trainer.actor``) calls :meth:`DrafterLearner.step` when its schedule allows and
:meth:`DrafterLearner.snapshot` to publish a version; the offline ``specroll drafter train`` and
:func:`specroll.drafter.train.train_drafter` run the same steps on saved rollouts.

Target features are computed once per rollout and policy version, over the whole rollout (capped
at ``max_context`` tokens), and cached in the replay buffer in bfloat16: a rollout drawn again
under the same policy costs no target forward pass, and a window cut from it still sees its full
context. A new policy version (:meth:`DrafterLearner.set_policy`) makes every cached feature stale;
each is recomputed the next time its rollout is drawn, so the head always learns the current
policy's features and teacher distributions (the teacher is recomputed from the cached final
hidden state and the target's current LM head).

Cold start: without a head, the first :meth:`step` after ``min_rollouts`` rollouts arrived builds
one (of ``config.architecture``, ``eagle3`` by default: its own LM head starts as the target's rows)
whose draft vocabulary is the rollouts' most frequent tokens (end-of-sequence tokens always in).
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F

from specroll.drafter.eagle_config import EagleConfig, build_draft_vocab, eagle3_feature_layers
from specroll.drafter.eagle_files import head_checksum
from specroll.drafter.eagle_head import EagleHead, draft_lm_head
from specroll.drafter.learner_config import LearnerConfig
from specroll.drafter.ttt import Rollout, target_features, ttt_loss, window_start
from specroll.engine.model import CausalLM


@dataclass(frozen=True)
class DrafterSnapshot:
    """One published drafter version: what travels to the generators."""

    version: int
    """Drafter version, 1, 2, ... (separate from policy versions)."""
    policy_version: int
    """The policy version the head was last trained against."""
    config_json: str
    """The head's :class:`EagleConfig` as JSON (its ``config.json``)."""
    tensors: dict[str, torch.Tensor]
    """:meth:`EagleHead.wire_tensors`: float32 weights and the int64 draft vocabulary, CPU."""
    checksum: str
    """:func:`head_checksum` of ``tensors``."""
    train_steps: int
    """Optimizer steps taken when it was taken."""


@dataclass(eq=False)
class _Entry:
    rollout: Rollout
    policy_version: int = -1
    """Policy version of the cached features; -1: none."""
    features: torch.Tensor | None = None
    """bfloat16 ``[T, F]`` taps."""
    final: torch.Tensor | None = None
    """bfloat16 ``[T, H]`` final normed hidden states (the teacher's input)."""


@dataclass
class _Counts:
    """Token occurrences over the rollouts seen so far (for a cold start's draft vocabulary)."""

    counts: torch.Tensor
    seen: int = 0


class DrafterLearner:
    """Trains an EAGLE head on a bounded buffer of recent rollouts of ``target`` (module docstring).

    Args:
        target: the policy, frozen here (its weights change only through :meth:`set_policy`).
        config: training settings.
        head: a warm start (checked against ``target``); ``None`` cold-starts from the rollouts.
        eos_token_ids: kept in a cold-started head's draft vocabulary.
        policy_version: the version ``target`` holds now.

    Raises:
        DrafterError: ``head`` was made for another target.
    """

    def __init__(self, target: CausalLM, config: LearnerConfig | None = None, head: EagleHead | None = None,
                 eos_token_ids: Sequence[int] = (), policy_version: int = 0) -> None:
        self.target = target.eval().requires_grad_(False)
        self.config = config or LearnerConfig()
        self.device = target.lm_head_weight.device
        self.eos_token_ids = tuple(eos_token_ids)
        self.policy_version = policy_version
        self.head: EagleHead | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0
        """Drafter versions published (:meth:`snapshot`); 0 before the first."""
        self.steps = 0
        """Optimizer steps taken."""
        self.trained_policy_version: int | None = None
        """The policy version of the last step's features, or ``None`` before any step."""
        self._buffer: deque[_Entry] = deque(maxlen=self.config.buffer_rollouts)
        self._counts = _Counts(torch.zeros(target.config.vocab_size, dtype=torch.float64))
        self._rng = random.Random(self.config.seed)
        if head is not None:
            head.check_target(target.config, "the warm-start drafter")
            self._set_head(head)

    # ---- inputs ---------------------------------------------------------------------------

    def add_rollout(self, token_ids: Sequence[int], prompt_len: int, policy_version: int = 0) -> None:
        """Keep one finished rollout (prompt + response ids) in the replay buffer.

        Raises:
            ValueError: no response token, or an id outside the target's vocabulary.
        """
        vocab = self.target.config.vocab_size
        if not 0 <= prompt_len < len(token_ids):
            raise ValueError(f"rollout of {len(token_ids)} tokens with prompt_len={prompt_len}: expected "
                             "at least one response token")
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"rollout token ids outside [0, {vocab})")
        ids = list(token_ids[: self.config.max_context])
        self._buffer.append(_Entry(Rollout(ids, min(prompt_len, len(ids) - 1), policy_version)))
        self._counts.counts += torch.bincount(torch.tensor(ids), minlength=vocab).double()
        self._counts.seen += 1

    def set_policy(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load policy ``version`` into the target; cached features go stale (recomputed when drawn).

        Raises:
            ValueError: a tensor name or shape the target does not have.
        """
        self.target.load_weights(named_tensors)
        self.policy_version = version

    @property
    def num_rollouts(self) -> int:
        """Rollouts in the replay buffer."""
        return len(self._buffer)

    @property
    def ready(self) -> bool:
        """A step can run: a head (or enough rollouts to cold-start one) and rollouts to train on."""
        return len(self._buffer) >= (1 if self.head is not None else self.config.min_rollouts)

    # ---- training -------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One AdamW step on ``batch`` windows drawn uniformly from the buffer.

        Returns:
            :func:`ttt_loss`'s metrics plus ``step``.

        Raises:
            RuntimeError: not :attr:`ready`.
        """
        if not self.ready:
            raise RuntimeError(f"drafter learner not ready: {len(self._buffer)} rollouts, "
                               f"{self.config.min_rollouts} needed for a cold start")
        if self.head is None:
            self._set_head(self._cold_start_head())
        head, opt = self.head, self.optimizer
        assert head is not None and opt is not None
        entries = [self._buffer[self._rng.randrange(len(self._buffer))] for _ in range(self.config.batch)]
        token_ids, mask, prompt_lens, features, final, teacher = self._batch(entries, head)
        head.train()
        loss, metrics = ttt_loss(head, self.target, token_ids, mask, prompt_lens, features, teacher,
                                 self.config.ttt_steps, final_hidden=final, hidden_weight=self.config.hidden_weight,
                                 objective=self.config.objective)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        head.eval()
        self.steps += 1
        self.trained_policy_version = self.policy_version
        return {"step": float(self.steps), **metrics}

    def snapshot(self) -> DrafterSnapshot:
        """Publish the head as the next drafter version.

        Raises:
            RuntimeError: no head yet (no step ran and no warm start).
        """
        if self.head is None:
            raise RuntimeError("no drafter to publish yet: no warm start and no training step")
        self.version += 1
        tensors = self.head.wire_tensors()
        policy = self.trained_policy_version if self.trained_policy_version is not None else self.policy_version
        return DrafterSnapshot(self.version, policy, json.dumps(msgspec.to_builtins(self.head.config)), tensors,
                               head_checksum(tensors), self.steps)

    # ---- internals ------------------------------------------------------------------------

    def _set_head(self, head: EagleHead) -> None:
        self.head = head.to(device=self.device, dtype=torch.float32)
        params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)

    def _cold_start_head(self) -> EagleHead:
        tc = self.target.config
        counts = self._counts.counts.clone()
        eos = [t for t in self.eos_token_ids if 0 <= t < tc.vocab_size]
        counts[eos] = float("inf")
        size = min(self.config.draft_vocab_size, tc.vocab_size)
        layers = (tc.num_layers,) if self.config.features == "last" else eagle3_feature_layers(tc.num_layers)
        config = EagleConfig.for_target(tc, layers, size, self.config.architecture)
        d2t = build_draft_vocab(counts, size)
        return EagleHead.init(config, d2t, seed=self.config.seed, lm_head=draft_lm_head(self.target, config, d2t))

    def _refresh(self, entries: Sequence[_Entry], head: EagleHead) -> None:
        """Compute the features of entries whose cache is missing or of an older policy version."""
        stale = list({id(e): e for e in entries if e.policy_version != self.policy_version}.values())
        for i in range(0, len(stale), 8):
            part = stale[i : i + 8]
            width = max(len(e.rollout.token_ids) for e in part)
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros(len(part), width, dtype=torch.bool)
            for b, e in enumerate(part):
                ids[b, : len(e.rollout.token_ids)] = torch.tensor(e.rollout.token_ids)
                mask[b, : len(e.rollout.token_ids)] = True
            layers = (*head.config.feature_layers, self.target.config.num_layers)
            taps, _, _ = target_features(self.target, ids.to(self.device), mask.to(self.device), layers, None)
            h = self.target.config.hidden_size
            for b, e in enumerate(part):
                n = len(e.rollout.token_ids)
                e.features = taps[b, :n, :-h].to(torch.bfloat16)
                e.final = taps[b, :n, -h:].to(torch.bfloat16)
                e.policy_version = self.policy_version

    def _batch(self, entries: Sequence[_Entry], head: EagleHead
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Windows of ``entries`` with their cached features and fresh teachers:
        ``token_ids, mask [B, W]``, ``prompt_lens [B]``, ``features [B, W, F]`` and the final hidden
        states ``[B, W, H]`` (the target's dtype), float32 ``teacher [B, W, Vd]`` (log-probabilities)."""
        self._refresh(entries, head)
        window = self.config.window
        rows = []
        for e in entries:
            start = window_start(e.rollout, window, self._rng)
            rows.append((e, start, min(len(e.rollout.token_ids), start + window)))
        w = max(end - start for _, start, end in rows)
        b, h = len(rows), self.target.config.hidden_size
        nf = entries[0].features.shape[-1]  # type: ignore[union-attr]
        token_ids = torch.zeros(b, w, dtype=torch.long)
        mask = torch.zeros(b, w, dtype=torch.bool)
        features = torch.zeros(b, w, nf)
        final = torch.zeros(b, w, h)
        prompt_lens = torch.zeros(b, dtype=torch.long)
        for i, (e, start, end) in enumerate(rows):
            n = end - start
            token_ids[i, :n] = torch.tensor(e.rollout.token_ids[start:end])
            mask[i, :n] = True
            features[i, :n] = e.features[start:end].float()  # type: ignore[index]
            final[i, :n] = e.final[start:end].float()  # type: ignore[index]
            prompt_lens[i] = max(0, e.rollout.prompt_len - start)
        dev = self.device
        weight = self.target.lm_head_weight.detach().index_select(0, head.draft_to_target.to(dev))
        final = final.to(dev, weight.dtype)
        teacher = F.linear(final, weight).float().log_softmax(-1)  # [B, W, Vd]
        return token_ids.to(dev), mask.to(dev), prompt_lens.to(dev), features.to(dev, weight.dtype), final, teacher

