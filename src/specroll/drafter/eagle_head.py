"""The EAGLE draft head: its two architectures and initialisation (its config: ``eagle_config.py``;
its files, safetensors + JSON: ``eagle_files.py``).

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

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from specroll.drafter.eagle3_layer import Eagle3Layer
from specroll.drafter.eagle_config import DrafterError, EagleConfig
from specroll.drafter.eagle_files import read_head_files, write_head_files
from specroll.engine.attention import AttentionBackend
from specroll.engine.model import CausalLM, DecoderLayer, RMSNorm, RotaryEmbedding
from specroll.engine.model_config import ModelConfig


def draft_lm_head(target: CausalLM, config: EagleConfig, draft_to_target: torch.Tensor) -> torch.Tensor | None:
    """The start of a new head's own LM head: float32 ``[draft_vocab_size, H]`` rows
    ``draft_to_target`` of ``target``'s LM head, on the CPU, for an ``eagle3`` ``config``; ``None``
    for ``eagle`` (it reads the target's)."""
    if config.architecture != "eagle3":
        return None
    weight = target.lm_head_weight.detach()
    return weight.index_select(0, draft_to_target.to(weight.device)).float().cpu()


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

    def save(self, path: str | Path, keep_previous: bool = False) -> None:
        """Write ``config.json`` and ``model.safetensors`` as the sealed folder ``path``
        (``eagle_files.write_head_files``: whole or not at all, with checksums; a drafter there is
        replaced, and kept as ``PATH.prev`` with ``keep_previous``).

        Raises:
            OSError: a file cannot be written (a full disk too), or ``path`` holds other files;
                ``path`` is left as it was.
        """
        write_head_files(Path(path), self.config, self.cpu_tensors(), keep_previous)

    def cpu_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict as contiguous CPU tensors (what the files hold)."""
        return {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}

    @classmethod
    def load(cls, path: str | Path) -> EagleHead:
        """Read a head saved by :meth:`save` (float32 or any float dtype; cast by the caller).

        Raises:
            DrafterError: a missing file, a malformed config, or tensors whose names or shapes do
                not match the config; the message names the file and the value.
        """
        config, tensors, source = read_head_files(Path(path))
        return cls.from_tensors(config, tensors, source)

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


