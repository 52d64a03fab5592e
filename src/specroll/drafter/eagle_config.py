"""The shape of an EAGLE head and of the target it was made for (:class:`EagleConfig`, its
``config.json``), the draft vocabulary, EAGLE-3's taps, and the largest tensor a head or a policy
version sends (what a receiver sizes its frames from)."""

from __future__ import annotations

import math
from typing import Literal, get_args

import msgspec
import torch

from specroll.engine.model_config import ModelConfig, expected_weight_shapes

Architecture = Literal["eagle", "eagle3"]
"""``eagle``: fc(2H → H) then a standard decoder layer, the target's LM head; ``eagle3``: EAGLE-3's
midlayer (2H-wide q/k/v) and its own LM head (module docstring)."""
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)


class DrafterError(ValueError):
    """A drafter file is missing, malformed, or made for another target."""


class EagleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of an EAGLE head and of the target it was made for."""

    target_vocab_size: int
    """Vocabulary of the target model (its embedding rows)."""
    hidden_size: int
    """The target's hidden size, and the head's."""
    intermediate_size: int
    """SwiGLU width of the head's decoder layer."""
    num_heads: int
    """Query heads of the head's decoder layer."""
    num_kv_heads: int
    """Key/value heads of the head's decoder layer."""
    head_dim: int
    """Width of one attention head."""
    rms_norm_eps: float
    """Epsilon of the head's RMSNorms."""
    rope_theta: float
    """RoPE base of the head's attention (the target's)."""
    feature_layers: tuple[int, ...]
    """Target taps (``CausalLM.forward``): ``(num_layers,)`` for EAGLE-1's final hidden state, or
    three layers (low, mid, high) for EAGLE-3's fusion."""
    draft_vocab_size: int
    """Tokens the head can propose (N)."""
    target_num_layers: int
    """Depth of the target model: with its vocabulary and width, identifies what the head fits."""
    format: int = 1
    """File-format version."""
    architecture: str = "eagle"
    """:data:`Architecture` of the head: ``eagle`` (files written before there was a choice) or
    ``eagle3`` (what ``specroll init-drafter``, ``specroll drafter train`` and the drafter trainer make)."""

    def __post_init__(self) -> None:
        for name in ("target_vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "draft_vocab_size", "target_num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"drafter config: {name}={getattr(self, name)}, expected a positive integer")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"drafter config: draft_vocab_size={self.draft_vocab_size} exceeds "
                             f"target_vocab_size={self.target_vocab_size}")
        if not self.feature_layers or not all(0 <= i <= self.target_num_layers for i in self.feature_layers):
            raise ValueError(f"drafter config: feature_layers={list(self.feature_layers)}, expected taps in "
                             f"[0, target_num_layers={self.target_num_layers}]")
        if self.format != 1:
            raise ValueError(f"drafter config: format={self.format}, this specroll reads format 1")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"drafter config: architecture={self.architecture!r}, expected 'eagle3' (EAGLE-3's "
                             "midlayer and own LM head) or 'eagle' (fc then a decoder layer, the target's LM head)")

    @classmethod
    def for_target(cls, target: ModelConfig, feature_layers: tuple[int, ...], draft_vocab_size: int,
                   architecture: str = "eagle3") -> EagleConfig:
        """A head shaped like one layer of ``target``, of ``architecture`` (new heads: ``eagle3``).

        Raises:
            ValueError: a tap outside ``[0, target.num_layers]``, a bad draft vocabulary size or an
                unknown architecture.
        """
        bad = [i for i in feature_layers if not 0 <= i <= target.num_layers]
        if bad:
            raise ValueError(f"feature layers {bad}: expected taps in [0, {target.num_layers}]")
        return cls(target.vocab_size, target.hidden_size, target.intermediate_size, target.num_heads,
                   target.num_kv_heads, target.head_dim, target.rms_norm_eps, target.rope_theta,
                   tuple(feature_layers), draft_vocab_size, target.num_layers, architecture=architecture)

    def check_target(self, target: ModelConfig, source: str = "the drafter") -> None:
        """Raise :class:`DrafterError` unless a head of this config fits ``target``'s vocabulary,
        width and depth (checked before a head is built, so a config from a peer never sizes one)."""
        made = (self.target_vocab_size, self.hidden_size, self.target_num_layers)
        if made != (target.vocab_size, target.hidden_size, target.num_layers):
            raise DrafterError(
                f"{source} was made for a target with vocabulary {self.target_vocab_size}, hidden size "
                f"{self.hidden_size} and {self.target_num_layers} layers; this model has vocabulary "
                f"{target.vocab_size}, hidden size {target.hidden_size} and {target.num_layers} layers"
            )

    def as_model_config(self) -> ModelConfig:
        """The one-layer decoder the head runs, as a :class:`ModelConfig`."""
        return ModelConfig("llama", self.draft_vocab_size, self.hidden_size, self.intermediate_size, 1,
                           self.num_heads, self.num_kv_heads, self.head_dim, self.rms_norm_eps,
                           self.rope_theta, 1 << 30, False)


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high taps ``(2, N//2, N−3)`` (vLLM ``get_eagle3_aux_hidden_state_layers``);
    below 6 layers ``(0, N//2, N−1)``, ascending and without repeats (one or two taps for N ≤ 2)."""
    taps = (2, num_layers // 2, num_layers - 3) if num_layers >= 6 else (0, num_layers // 2, num_layers - 1)
    return tuple(sorted(set(taps)))


def max_tensor_bytes(target: ModelConfig) -> int:
    """The largest tensor frame a peer sends about ``target``, in bytes: one of its weights (a policy
    version, float32 at most) or of an EAGLE head for it (float32; its int64 ``draft_to_target`` is
    shorter than its LM head). A head's biggest tensors are its LM head (a draft vocabulary at most
    the target's), the fusion over its taps (at most one per layer and the embeddings) and its
    midlayer's fused gate/up and qkv over ``2H`` (``EagleHead``, ``Eagle3Layer``). What a receiver
    sizes ``MAXMSGSIZE`` from (``protocol.limits.frame_limit``)."""
    h = target.hidden_size
    head = max(target.vocab_size * h, (target.num_layers + 1) * h * h, 2 * target.intermediate_size * h,
               (target.num_heads + 2 * target.num_kv_heads) * target.head_dim * 2 * h)
    weights = max(math.prod(shape) for shape in expected_weight_shapes(target).values())
    return 4 * max(head, weights)


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target tokens, as ``draft_to_target`` (EAGLE-3's ``scandata``).

    Args:
        token_counts: ``[V]`` occurrences of each target token in some corpus (e.g. rollouts).
        size: draft vocabulary size N, ``1 ≤ N ≤ V``.

    Returns:
        int64 ``[N]`` target ids, ascending (ties broken by the lower id).

    Raises:
        ValueError: ``size`` out of range.
    """
    if not 1 <= size <= token_counts.numel():
        raise ValueError(f"draft vocabulary size {size}: expected 1..{token_counts.numel()}")
    order = sorted(range(token_counts.numel()), key=lambda t: (-float(token_counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)
