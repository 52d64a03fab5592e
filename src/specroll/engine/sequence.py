"""One request's state inside the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specroll.protocol.messages import FinishReason
from specroll.protocol.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt and the response tokens generated for it so far.

    ``token_ids`` holds prompt + response; ``num_computed_tokens`` of them have K/V in the cache
    (pages listed in ``block_table``). After a preemption the count drops to zero and the whole
    sequence is prefilled again (recompute).
    """

    request_id: str
    group_id: str | None
    prompt_len: int
    token_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None
    arrival: int
    max_len: int
    """Hard cap on ``len(token_ids)``: the prompt plus ``max_tokens``, at most the context length."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    prefix_cacheable: bool = True
    """False once the sequence's K/V mixes weight versions: its pages are never shared."""
    num_keyed_pages: int = 0
    last_page_hash: int = 0
    admitted: bool = False
    """Set when the block manager first gives it pages; its prompt is counted then, once
    (:class:`~specroll.engine.block_manager.PrefixCacheCounters`)."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def stop_reason(self, token: int, eos_token_ids: frozenset[int]) -> FinishReason | None:
        """Why the sequence ends with ``token`` just appended: ``stop`` (an end-of-sequence token
        unless ``ignore_eos``, or a stop token), ``length`` (it reached ``max_len``), else ``None``."""
        if not self.sampling.ignore_eos and token in eos_token_ids:
            return "stop"
        if token in self.sampling.stop_token_ids:
            return "stop"
        if self.num_tokens >= self.max_len:
            return "length"
        return None

    def append_tokens(
        self, tokens: list[int], logprobs: list[float], version: int, eos_token_ids: frozenset[int]
    ) -> tuple[int, FinishReason | None]:
        """Append ``tokens`` (behavior ``logprobs``, policy ``version``) in order until one finishes
        the sequence (:meth:`stop_reason`); the tokens after it are dropped.

        Returns:
            How many tokens were appended, and why the sequence finished (``None``: it goes on).
        """
        kept = 0
        for token, logprob in zip(tokens, logprobs, strict=True):
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.versions.append(version)
            kept += 1
            finish = self.stop_reason(token, eos_token_ids)
            if finish is not None:
                return kept, finish
        return kept, None


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request: a delta, not the whole sequence.

    ``new_token_ids``, ``new_logprobs`` and ``new_versions`` are aligned: token i was sampled from
    the processed distribution (see :class:`~specroll.protocol.sampling.SamplingParams`) with
    behavior logprob ``new_logprobs[i]`` (natural log) under the weights of policy version
    ``new_versions[i]``.
    """

    request_id: str
    group_id: str | None
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_versions: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_output_tokens: int
    """Response tokens of the request so far, these included."""


@dataclass(frozen=True)
class Completion:
    """A request's whole result: returned by ``Engine.abort`` (every token produced so far)."""

    request_id: str
    group_id: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason

    @classmethod
    def of(cls, seq: Sequence) -> Completion:
        assert seq.finish_reason is not None
        return cls(
            request_id=seq.request_id,
            group_id=seq.group_id,
            prompt_token_ids=seq.token_ids[: seq.prompt_len],
            token_ids=seq.output_token_ids,
            logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            finish_reason=seq.finish_reason,
        )
