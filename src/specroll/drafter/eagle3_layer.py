"""EAGLE-3's single draft decoder layer (the "midlayer"), over the paged KV cache and densely.

For the next token's embedding ``e`` and a feature ``g`` (EAGLE-3's fused target taps, or the
head's own previous pre-norm output):

    x   = [input_layernorm(e) ; hidden_norm(g)]          # [T, 2H]: q/k/v read both halves
    r   = g + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))   # the residual is the un-normed g
    out = r + mlp(post_attention_layernorm(r))           # pre-norm output: the next step's feature

so ``q_proj``/``k_proj``/``v_proj`` are ``2H``-wide and ``o_proj`` maps back to ``H`` (Li et al. 2025,
"EAGLE-3", arXiv 2503.01840 §3; vLLM ``vllm/model_executor/models/llama_eagle3.py``
``LlamaDecoderLayer`` with ``norm_before_residual`` false, its default; SGLang
``python/sglang/srt/models/llama_eagle3.py`` ``LlamaDecoderLayer``; SafeAILab/EAGLE
``eagle/traineagle3/cnets.py`` ``LlamaDecoderLayeremb``). The parameter names are the engine's
(fused ``qkv_proj`` rows ``[q; k; v]``, ``gate_up_proj`` rows ``[gate; up]``);
``specroll.drafter.eagle3_format`` maps them to the checkpoint names vLLM and SGLang load.
"""

from __future__ import annotations

import torch
from torch import nn

from specroll.engine.attention import AttentionBackend
from specroll.engine.model import MLP, RMSNorm
from specroll.engine.model_config import ModelConfig
from specroll.engine.rope import apply_rope


class Eagle3Attention(nn.Module):
    """GQA self-attention whose q/k/v read ``[e ; g]`` (``2H`` wide) and whose output is ``H`` wide."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h = config.hidden_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(2 * h, self.q_size + 2 * self.kv_size, bias=False)  # rows [q; k; v]
        self.o_proj = nn.Linear(self.q_size, h, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v for ``x`` ``[..., T, 2H]``: ``[..., T, H_q, D]``, ``[..., T, H_kv, D]`` twice, q and k
        rotated by ``cos``/``sin`` (broadcastable to ``[..., T, 1, D]``)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # [..., T, H_q, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [..., T, H_kv, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3Layer(nn.Module):
    """The midlayer (module docstring). ``config``: the head's one-layer :class:`ModelConfig`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)  # SwiGLU, gate/up fused

    def project(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (:meth:`Eagle3Attention.project`) of ``[input_layernorm(embeds) ; hidden_norm(hidden)]``,
        both ``[..., T, H]``."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [..., T, 2H]
        return self.self_attn.project(x, cos, sin)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: ``r = hidden + o_proj(attn_out)`` (``attn_out``
        ``[..., T, H_q·D]``), then ``r + mlp(post_attention_layernorm(r))``, ``[..., T, H]``."""
        r = hidden + self.self_attn.o_proj(attn_out)
        return r + self.mlp(self.post_attention_layernorm(r))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The layer over the paged KV cache, appending the new K/V.

        Args:
            embeds: ``[T, H]`` embeddings of the next tokens.
            hidden: ``[T, H]`` features (fused taps, or the head's previous outputs).
            cos, sin: ``[T, 1, D]`` from ``RotaryEmbedding.cos_sin``.
            kv_cache: ``[num_pages, 2, page_size, H_kv, D]``.
            backend: an attention backend planned for this batch.

        Returns:
            ``[T, H]`` pre-norm outputs.
        """
        q, k, v = self.project(embeds, hidden, cos, sin)  # [T, H(_kv), D]
        o = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache)  # [T, H_q, D]
        return self.finish(hidden, o.reshape(o.shape[0], -1))
