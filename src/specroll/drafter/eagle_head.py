"""The EAGLE draft head: its two architectures, initialisation, and its file format (safetensors + JSON).

``architecture = "eagle"`` (EAGLE-1's head with EAGLE-3's taps; Li et al. 2024, "EAGLE", arXiv
2401.15077 §4.1; TLT's ``qwen2_eagle.py`` in mit-han-lab/fastrl). For target features ``f_t`` (the
taps of :meth:`CausalLM.forward`) and the next token ``x_{t+1}``:

    g_t = fuse([f_t^low ; f_t^mid ; f_t^high])      # only with several taps
    h_t = layer(fc([embed(x_{t+1}) ; g_t]))          # 2H → H, then a standard decoder layer
    q(x_{t+2}) = softmax(head_D(norm(h_t)))          # the target's LM head, rows of the draft vocab

``architecture = "eagle3"`` (Li et al. 2025, "EAGLE-3", arXiv 2503.01840 §3, as vLLM
``vllm/model_executor/models/llama_eagle3.py`` and SGLang ``python/sglang/srt/models/llama_eagle3.py``
define it; the layer is :class:`~specroll.drafter.eagle3_layer.Eagle3Layer`):

    g_t = fc([f_t^low ; f_t^mid ; f_t^high])         # n_taps·H → H, only with several taps
    h_t = midlayer(embed(x_{t+1}), g_t)              # q/k/v read [input_layernorm(e) ; hidden_norm(g)]
    q(x_{t+2}) = softmax(lm_head(norm(h_t)))         # its own lm_head: H → draft vocab, trained

When drafting further than one token the head's own pre-norm output ``h_t`` stands in for the
unknown target feature: ``g_{t+1} = h_t`` (no ``fuse``/``fc`` fusion then).

The embedding is the target's, frozen and shared (not in the file); so is the "eagle" head's LM
head. The head is restricted to a draft vocabulary of the N most frequent target tokens,
``draft_to_target[i]`` being the target id of draft token i (EAGLE-3's ``d2t`` holds offsets
``d2t[i] = draft_to_target[i] − i``; the file here stores absolute ids). An "eagle3" head's ids
ascend, so its ``lm_head`` rows are in target-id order (what :class:`EagleProposer` assumes).

A drafter is a directory holding ``config.json`` (:class:`EagleConfig`) and ``model.safetensors``;
``specroll.drafter.eagle3_format`` converts an "eagle3" one to and from the EAGLE-3 checkpoint
vLLM and SGLang load.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, get_args

import msgspec
import safetensors
import torch
from safetensors.torch import save_file
from torch import nn

from specroll.drafter.eagle3_layer import Eagle3Layer
from specroll.engine.attention import AttentionBackend
from specroll.engine.model import CausalLM, DecoderLayer, RMSNorm, RotaryEmbedding
from specroll.engine.model_config import ModelConfig, expected_weight_shapes

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

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


def draft_lm_head(target: CausalLM, config: EagleConfig, draft_to_target: torch.Tensor) -> torch.Tensor | None:
    """The start of a new head's own LM head: float32 ``[draft_vocab_size, H]`` rows
    ``draft_to_target`` of ``target``'s LM head, on the CPU, for an ``eagle3`` ``config``; ``None``
    for ``eagle`` (it reads the target's)."""
    if config.architecture != "eagle3":
        return None
    weight = target.lm_head_weight.detach()
    return weight.index_select(0, draft_to_target.to(weight.device)).float().cpu()


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


class EagleHead(nn.Module):
    """The trainable part of an EAGLE drafter, either architecture (see the module docstring).

    Parameters (state-dict names): ``eagle``: ``fuse.weight`` ``[H, n_taps·H]`` (several taps only),
    ``fc.weight`` ``[H, 2H]``, ``layer.*`` (a :class:`DecoderLayer`), ``norm.weight``; ``eagle3``:
    ``fc.weight`` ``[H, n_taps·H]`` (several taps only), ``layer.*`` (an :class:`Eagle3Layer`),
    ``norm.weight``, ``lm_head.weight`` ``[draft_vocab_size, H]``. Both: the int64 buffer
    ``draft_to_target``.

    Args:
        config: its shape.
        draft_to_target: int64 ``[draft_vocab_size]`` distinct target ids (ascending for ``eagle3``).

    Raises:
        ValueError: ``draft_to_target`` has the wrong length, repeats an id, leaves the vocabulary
            or, for ``eagle3``, does not ascend.
    """

    def __init__(self, config: EagleConfig, draft_to_target: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.eagle3 = config.architecture == "eagle3"
        h = config.hidden_size
        n_taps = len(config.feature_layers)
        fusion = nn.Linear(n_taps * h, h, bias=False) if n_taps > 1 else None
        self.fuse: nn.Linear | None = None
        self.fc: nn.Linear | None
        self.layer: DecoderLayer | Eagle3Layer
        self.lm_head: nn.Linear | None = None
        if self.eagle3:
            self.fc = fusion  # EAGLE-3's fc is the fusion; embedding and feature meet in the midlayer
            self.layer = Eagle3Layer(config.as_model_config())
        else:
            self.fuse = fusion
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.layer = DecoderLayer(config.as_model_config())
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if self.eagle3:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        d2t = draft_to_target.long().cpu()
        if d2t.shape != (config.draft_vocab_size,):
            raise ValueError(f"draft_to_target: shape {tuple(d2t.shape)}, expected ({config.draft_vocab_size},)")
        if d2t.unique().numel() != d2t.numel():
            raise ValueError("draft_to_target: repeats a target id; expected distinct ids")
        if d2t.numel() and not (0 <= int(d2t.min()) and int(d2t.max()) < config.target_vocab_size):
            raise ValueError(f"draft_to_target: ids outside the target vocabulary [0, {config.target_vocab_size})")
        if self.eagle3 and d2t.numel() > 1 and not bool((d2t[1:] > d2t[:-1]).all()):
            # the proposer reads logit column i as the i-th smallest draft id (eagle.py, attach)
            raise ValueError("draft_to_target: an eagle3 head's ids must ascend (its lm_head rows in target-id order)")
        self.register_buffer("draft_to_target", d2t)

    @classmethod
    def init(cls, config: EagleConfig, draft_to_target: torch.Tensor, seed: int = 0,
             lm_head: torch.Tensor | None = None) -> EagleHead:
        """A freshly initialised head (normal(0, 0.02) matrices, unit norms), to be trained.

        Args:
            lm_head: ``eagle3`` only: ``[draft_vocab_size, H]`` the target's LM-head rows of the draft
                vocabulary (``lm_head_weight[draft_to_target]``), the start of the head's own LM head
                (EAGLE-3 heads are made this way so the untrained head already reads the target's
                output space); ``None`` leaves it random.

        Raises:
            ValueError: ``lm_head`` for an ``eagle`` head, or of another shape.
        """
        head = cls(config, draft_to_target)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            if lm_head is not None:
                if head.lm_head is None:
                    raise ValueError("lm_head: an 'eagle' head uses the target's LM head and has none of its own")
                if tuple(lm_head.shape) != tuple(head.lm_head.weight.shape):
                    raise ValueError(f"lm_head: shape {tuple(lm_head.shape)}, expected "
                                     f"{tuple(head.lm_head.weight.shape)} (draft vocabulary × hidden size)")
                head.lm_head.weight.copy_(lm_head)
        return head

    def _fused(self, features: torch.Tensor, from_target: bool) -> torch.Tensor:
        """The feature entering the layer: target taps fused when there are several."""
        fusion = self.fc if self.eagle3 else self.fuse
        return fusion(features) if from_target and fusion is not None else features

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        from_target: bool,
    ) -> torch.Tensor:
        """One ragged batch of (feature, next token) pairs through the head, appending its K/V.

        Args:
            embeds: ``[T, H]`` target embeddings of the next tokens ``x_{t+1}``.
            features: ``[T, n_taps·H]`` target taps (``from_target``) or ``[T, H]`` the head's own
                earlier outputs.
            positions: int64 ``[T]`` positions t.
            kv_cache: the head's cache ``[num_pages, 2, page_size, num_kv_heads, head_dim]``.
            backend: an attention backend planned for this batch.
            from_target: whether ``features`` are target taps (fused first when several).

        Returns:
            ``[T, H]`` pre-norm outputs ``h_t``; logits come from :meth:`draft_logits`.
        """
        g = self._fused(features, from_target)  # [T, H]
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        if isinstance(self.layer, Eagle3Layer):
            return self.layer(embeds, g, cos, sin, kv_cache, backend)
        assert self.fc is not None
        x = self.fc(torch.cat([embeds, g], dim=-1))  # [T, H]
        return self.layer(x, cos, sin, kv_cache, backend)

    def forward_dense(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
        from_target: bool,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One unrolled step of EAGLE-3's training-time test over a padded batch, differentiable.

        Row t of step i stands for draft i from the last verified position t: it sits at position
        ``t + i`` and attends, as :meth:`forward` does at inference, to the step-0 keys of rows
        ``0..t`` (computed from target features) and to its own row's keys of steps ``1..i`` (the
        earlier drafts) — causal over step 0, diagonal over later steps (arXiv 2503.01840 §3.3;
        ``cache_hidden`` in SafeAILab/EAGLE ``traineagle3/cnets.py``). Same parameters as :meth:`forward`.
        Rows are right-padded; padded rows see only keys before them, so mask them out of any loss.

        Args:
            embeds: ``[B, T, H]`` target embeddings of the input tokens.
            features: ``[B, T, n_taps·H]`` target taps (``from_target``, step 0) or ``[B, T, H]`` the
                previous step's outputs.
            positions: int64 ``[B, T]`` RoPE positions.
            past: ``(k, v)`` of the earlier steps, each ``[B, T, H_kv, D]`` (empty at step 0).
            from_target: whether ``features`` are target taps (fused first when several).

        Returns:
            ``[B, T, H]`` pre-norm outputs, and this step's ``(k, v)`` to append to ``past``.
        """
        g = self._fused(features, from_target)  # [B, T, H]
        b, t, _ = g.shape
        cos, sin = self.rotary.cos_sin(positions.flatten(), g.dtype)
        cos, sin = cos.view(b, t, 1, -1), sin.view(b, t, 1, -1)  # [B, T, 1, D]
        layer = self.layer
        if isinstance(layer, Eagle3Layer):
            residual = g  # EAGLE-3: the un-normed feature (vLLM: norm_before_residual false)
            q, k, v = layer.project(embeds, g, cos, sin)  # [B, T, H(_kv), D]
        else:
            assert self.fc is not None
            residual = self.fc(torch.cat([embeds, g], dim=-1))  # [B, T, H]
            q, k, v = layer.self_attn.project(layer.input_layernorm(residual), cos, sin)
        attn = layer.self_attn
        steps = [*past, (k, v)]
        rep = attn.num_heads // attn.num_kv_heads  # GQA: key/value head j serves query heads j·rep..
        keys = [kk.repeat_interleave(rep, dim=2) for kk, _ in steps]  # [B, T, Hq, D]
        values = [vv.repeat_interleave(rep, dim=2) for _, vv in steps]
        scale = attn.head_dim ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=g.device).tril()  # [T, T] key j <= query t
        s0 = torch.einsum("bthd,bshd->bhts", q, keys[0]) * scale  # [B, Hq, T, T] step-0 keys
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [torch.einsum("bthd,bthd->bht", q, kk)[..., None] * scale for kk in keys[1:]]  # [B, Hq, T, 1]
        probs = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # [B, Hq, T, T+i]
        o = torch.einsum("bhts,bshd->bthd", probs[..., :t], values[0])  # [B, T, Hq, D]
        for j, vv in enumerate(values[1:]):
            o = o + probs[..., t + j].transpose(1, 2)[..., None] * vv
        x = residual + attn.o_proj(o.flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, (k, v)

    def draft_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[..., draft_vocab_size]`` logits from pre-norm outputs ``[..., H]``.

        ``eagle``: through ``head_weight``, the target's LM-head rows of the draft vocabulary
        ``[draft_vocab_size, H]`` (required); ``eagle3``: through the head's own ``lm_head``
        (``head_weight`` is ignored).
        """
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden)).float()
        assert head_weight is not None, "an 'eagle' head drafts through the target's LM-head rows"
        return torch.nn.functional.linear(self.norm(hidden), head_weight).float()

    def check_target(self, target: ModelConfig, source: str = "the drafter") -> None:
        """Raise :class:`DrafterError` unless this head was made for ``target``'s vocabulary, width and depth."""
        self.config.check_target(target, source)

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into directory ``path`` (made if missing).

        Each file is written to a temporary name and renamed, so a reader never sees half a file.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}
        _write_atomic(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata={"format": "specroll-eagle"}))
        _write_atomic(path / CONFIG_FILE, lambda tmp: Path(tmp).write_bytes(msgspec.json.format(
            msgspec.json.encode(self.config), indent=2)))

    @classmethod
    def load(cls, path: str | Path) -> EagleHead:
        """Read a head saved by :meth:`save` (float32 or any float dtype; cast by the caller).

        Raises:
            DrafterError: a missing file, a malformed config, or tensors whose names or shapes do
                not match the config; the message names the file and the value.
        """
        path = Path(path)
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        writers = "as 'specroll init-drafter' or 'specroll drafter train' write it"
        made_by = f"expected a drafter directory ({CONFIG_FILE} + {WEIGHTS_FILE}) {writers}"
        if not path.is_dir():
            raise DrafterError(f"drafter {path}: {'not a directory' if path.exists() else 'does not exist'}; {made_by}")
        for p in (config_path, weights_path):
            if not p.is_file():
                raise DrafterError(f"drafter {path}: {p.name} not found; {made_by}")
        try:
            raw = config_path.read_bytes()
        except OSError as exc:
            raise DrafterError(f"drafter {config_path}: cannot read it ({exc.strerror or exc})") from None
        try:
            config = msgspec.json.decode(raw, type=EagleConfig)
            config.as_model_config()  # the head's layer shape is valid
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            # EagleConfig's own range checks say what they expected; msgspec's messages do not
            hint = "" if str(exc).startswith("drafter config:") else f"; expected a drafter config {writers}"
            if b'"architectures"' in raw:  # a Hugging Face style config: vLLM's / SGLang's EAGLE-3 format
                hint = ("; this looks like an EAGLE-3 checkpoint as vLLM and SGLang load it: convert it with "
                        "'specroll drafter import CHECKPOINT --out DIR' and use DIR")
            raise DrafterError(f"drafter {config_path}: {exc}{hint}") from None
        try:
            with safetensors.safe_open(str(weights_path), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, safetensors.SafetensorError) as exc:
            raise DrafterError(f"drafter {weights_path}: not a readable safetensors file ({exc})") from None
        return cls.from_tensors(config, tensors, f"drafter {weights_path}")

    @classmethod
    def from_tensors(cls, config: EagleConfig, tensors: Mapping[str, torch.Tensor],
                     source: str = "drafter") -> EagleHead:
        """A head from its config and state dict (a file's, or one received over the wire).

        Raises:
            DrafterError: missing or unexpected tensors, a shape the config does not give, a wrong
                dtype kind, or NaN/infinite values; the message starts with ``source``.
        """
        expected = {name: tuple(t.shape) for name, t in cls._shapes(config).items()}
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise DrafterError(f"{source}: missing tensors {missing[:4]}, unexpected tensors "
                               f"{unexpected[:4]} for the head its config describes")
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise DrafterError(f"{source}: {name} has shape {tuple(tensors[name].shape)}, "
                                   f"its config makes it {shape}")
            wanted = "integer" if name == "draft_to_target" else "floating-point"
            if tensors[name].is_floating_point() != (wanted == "floating-point"):
                raise DrafterError(f"{source}: {name} has dtype {tensors[name].dtype}, expected {wanted}")
            if wanted == "floating-point" and not torch.isfinite(tensors[name]).all():
                raise DrafterError(f"{source}: {name} holds NaN or infinite values")
        try:
            head = cls(config, tensors["draft_to_target"].long())
        except ValueError as exc:
            raise DrafterError(f"{source}: {exc}") from None
        head.load_state_dict({name: t for name, t in tensors.items() if name != "draft_to_target"}, strict=False)
        return head

    def wire_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict as it travels and is checksummed: float32 weights and the int64
        ``draft_to_target``, on the CPU, contiguous."""
        return {name: t.detach().to("cpu", torch.float32 if t.is_floating_point() else torch.int64).contiguous()
                for name, t in self.state_dict().items()}


    @staticmethod
    def _shapes(config: EagleConfig) -> dict[str, torch.Tensor]:
        """The state dict a head with ``config`` has: shapes only (meta tensors, no memory, whatever
        sizes the config names), but ``draft_to_target`` ``[draft_vocab_size]`` on the CPU."""
        d2t = torch.arange(config.draft_vocab_size)
        with torch.device("meta"):
            return dict(EagleHead(config, d2t).state_dict())


def head_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over a head's tensors in name order: each name, dtype, shape and raw bytes.

    The drafter trainer publishes it with a version; a generator recomputes it on what it received
    and serves the head only when the two agree.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _write_atomic(target: Path, write: Callable[[str], object]) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
