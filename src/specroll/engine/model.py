"""A Llama-family decoder over the paged KV cache: Llama/SmolLM2, Qwen2 and Qwen3.

Pre-norm decoder layers (RMSNorm → attention with RoPE and GQA → residual → RMSNorm → SwiGLU →
residual), final RMSNorm and an LM head tied or not to the embedding (Touvron et al. 2023,
"LLaMA"; Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k before RoPE). Parameter
names are Hugging Face's, so checkpoints and weight updates load by name.

The forward pass takes one ragged batch of new tokens (``[T]``, no padding); attention goes
through an :class:`~specroll.engine.attention.AttentionBackend` planned for that batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from specroll.engine import cpu_linear
from specroll.engine.attention import AttentionBackend
from specroll.engine.fused_weights import _fused_slot, fuse_weights, unfuse_weights
from specroll.engine.head_logprobs import head_logprobs
from specroll.engine.model_config import ModelConfig
from specroll.engine.paged_forward import LayerWeights, paged_layer, paged_layers
from specroll.engine.rope import RotaryEmbedding, apply_rope

__all__ = ["CausalLM", "DecoderLayer", "RMSNorm", "RotaryEmbedding", "apply_rope", "fuse_weights", "unfuse_weights"]

PagedLayers = Callable[[torch.Tensor, list[LayerWeights], torch.Tensor, torch.Tensor, list[torch.Tensor],
                        AttentionBackend, tuple[int, ...]], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
"""The decoder layers over the paged KV cache: ``paged_forward.paged_layers`` or a compiled form of it."""


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dimension (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: rows [q; k; v] (checkpoint names map into it, see FUSED)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v for ``x`` ``[..., T, hidden]``: ``[..., T, H, D]``, ``[..., T, H_kv, D]`` twice.

        q/k normed (Qwen3) then rotated by ``cos``/``sin`` (broadcastable to ``[..., T, 1, D]``);
        the dense training path (:meth:`forward_dense`); the paged path inlines the same maths
        (``paged_forward.paged_layer``).
        """
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # [..., T, H, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [..., T, H_kv, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_dense(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention over a padded batch ``x`` ``[B, T, hidden]`` with no KV cache (training).

        ``cos``/``sin``: ``[B, T, 1, D]``; ``attn_mask``: bool ``[B, 1, T, T]``, True where query
        i may attend to key j. Returns ``[B, T, hidden]``.
        """
        q, k, v = self.project(x, cos, sin)  # [B, T, H(_kv), D]
        o = F.scaled_dot_product_attention(  # [B, H, T, D]; scale 1/sqrt(D) as the paged backends
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, enable_gqa=True
        )
        return self.o_proj(o.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate and up in one matmul: rows [gate; up]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The layer over the paged KV cache (``paged_forward.paged_layer``): ``[T, hidden]`` in and out."""
        return paged_layer(x, self.weights(), cos, sin, kv_cache, backend)

    def weights(self) -> LayerWeights:
        """The layer's parameters for the paged path (the tensors themselves)."""
        attn, mlp = self.self_attn, self.mlp
        return LayerWeights(
            self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
            None if attn.q_norm is None else attn.q_norm.weight, None if attn.k_norm is None else attn.k_norm.weight,
            attn.o_proj.weight, self.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            self.input_layernorm.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size,
        )

    def forward_dense(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`forward` over a padded batch ``[B, T, hidden]`` without KV cache (see ``CausalLM.score``)."""
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Hugging Face's ``model.*``: embedding, layers and final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its LM head.

    q/k/v and gate/up projections are stored fused (one matmul each); :meth:`load_weights` takes
    tensors under the checkpoint's unfused Hugging Face names and copies them into place.

    Args:
        config: the architecture.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        self._layer_weights: list[LayerWeights] | None = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # to(), to_empty(), cuda() ... make new parameter tensors: fetch the layer weights again.
        self._layer_weights = None
        return super()._apply(fn, recurse)

    def layer_weights(self) -> list[LayerWeights]:
        """Each decoder layer's weights for the paged path (fetched once; in-place updates show)."""
        if self._layer_weights is None:
            self._layer_weights = [layer.weights() for layer in self.model.layers]
        return self._layer_weights

    @torch.no_grad()
    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy tensors named as in a Hugging Face checkpoint into the (fused) parameters.

        Tensors are cast to each parameter's dtype and device. Names and shapes must already be
        validated (``checkpoint.check_weights``); an unknown name raises KeyError.
        """
        params = dict(self.named_parameters())
        changed = set()
        for name, tensor in named_tensors.items():
            slot = _fused_slot(self.config, name)
            if slot is None:
                params[name].copy_(tensor)
                changed.add(name)
            else:
                fused, start, rows = slot
                params[fused][start : start + rows].copy_(tensor)
                changed.add(fused)
        for name in changed:  # a packed copy (``pack_matmul_weights``) follows its weight
            cpu_linear.repack(params[name])

    def matmul_weights(self) -> list[torch.Tensor]:
        """The weights the paged path multiplies by: each layer's q/k/v, o, gate/up and down, and the LM head."""
        return [*(t for w in self.layer_weights() for t in (w.qkv, w.o, w.gate_up, w.down)), self.lm_head_weight]

    def pack_matmul_weights(self) -> int:
        """Give each of :meth:`matmul_weights` a oneDNN-packed copy (``cpu_linear.py``; bf16 on a CPU
        only: see ``cpu_linear.packing_problem``), which the paged path and :meth:`compute_logits`
        then multiply by; :meth:`load_weights` packs what it changes again. Returns the packed bytes."""
        return cpu_linear.pack_all(self.matmul_weights())

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face names: the inverse of :meth:`load_weights`.

        Exactly the names and shapes of ``model_config.expected_weight_shapes(config)``, in its order:
        q/k/v and gate/up are row slices of the fused ``qkv_proj`` / ``gate_up_proj`` parameters
        (see ``_fused_slot``) and a tied LM head is omitted. So ``load_weights(hf_weights())`` and
        ``Engine.update_weights(hf_weights(), version)`` round-trip.

        Returns:
            name → tensor of the parameters' dtype and device, detached: *views* that share storage
            with the parameters (they change when training steps; clone to keep a snapshot, and
            make them contiguous copies before ``safetensors.save_file``, which refuses shared storage).
        """
        return unfuse_weights(self.config, {name: p.detach() for name, p in self.named_parameters()})

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab_size, hidden_size]``: the LM head (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        feature_layers: tuple[int, ...] = (),
        layers: PagedLayers = paged_layers,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the step's new tokens through the decoder, appending their K/V to the caches.

        Args:
            input_ids: int64 ``[T]`` new tokens of every sequence, concatenated.
            positions: int64 ``[T]`` their positions.
            kv_caches: per layer ``[num_pages, 2, page_size, num_kv_heads, head_dim]``.
            backend: attention backend already planned for this batch.
            feature_layers: hidden states to tap for a drafter (EAGLE): tap ``i < num_layers`` is
                the residual stream entering layer ``i`` (EAGLE-3's taps, arXiv 2503.01840);
                tap ``num_layers`` is the final normed hidden state the LM head reads (EAGLE-1's).
            layers: runs the decoder layers (``paged_layers``, or its compiled form: ``compiled_step.py``).

        Returns:
            ``[T, hidden_size]`` final hidden states (after the last RMSNorm), and the taps
            concatenated in order, ``[T, len(feature_layers) * hidden_size]`` (None without taps).
        """
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        num_layers = len(self.model.layers)
        inner = tuple(sorted({i for i in feature_layers if i < num_layers}))
        x, inner_taps = layers(x, self.layer_weights(), cos, sin, kv_caches, backend, inner)
        hidden = self.model.norm(x)
        if not feature_layers:
            return hidden, None
        taps = {**dict(zip(inner, inner_taps, strict=True)), num_layers: hidden}
        return hidden, torch.cat([taps[i] for i in feature_layers], dim=-1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab_size]`` logits for hidden states ``[N, hidden_size]``."""
        return cpu_linear.linear(hidden, self.lm_head_weight, None).float()

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Differentiable dense forward for training: float32 logits ``[B, T, vocab_size]``.

        No KV cache and no inference mode, so gradients reach every parameter; the same modules
        and weights as :meth:`forward`, so trainer and generator run one implementation. Each row
        is one sequence, right-padded: token ``t`` of a row sits at RoPE position ``t`` (in
        general, the number of valid tokens before it) and attends causally to the row's valid
        tokens only, through ``F.scaled_dot_product_attention`` with GQA. Logits at padded
        positions are finite but meaningless; mask them out of any loss.

        Args:
            input_ids: int64 ``[B, T]`` token ids (padding positions may hold any valid id).
            attention_mask: bool ``[B, T]``, True at real tokens.

        Returns:
            float32 ``[B, T, vocab_size]``: row b, position t predicts token t + 1.

        Raises:
            ValueError: ``input_ids`` is not 2-D integer, or ``attention_mask`` is not bool of the
                same shape.
        """
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be int64 or int32 [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if attention_mask.shape != input_ids.shape or attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attention_mask must be bool with input_ids' shape {tuple(input_ids.shape)}, "
                f"got {attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
        t = input_ids.shape[1]
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: 0..len-1 on real tokens
        # query i sees key j when j <= i and j is a real token
        idx = torch.arange(t, device=input_ids.device)
        causal = idx[None, :] <= idx[:, None]  # [T, T]
        hidden = self.hidden_dense(input_ids, positions, causal & attention_mask[:, None, :])
        return F.linear(hidden, self.lm_head_weight).float()

    def logprobs_at(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor,
                    rows: torch.Tensor, columns: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        """:meth:`hidden_dense`, then the logprob of ``targets[i]`` predicted at ``(rows[i], columns[i])``:
        float32 ``[N]``, differentiable (the GRPO step's forward, ``rl/grpo_step.response_logprobs``).
        The LM head runs only there, ``chunk`` tokens at a time (``head_logprobs.py``; 0: all at once).
        One method, so a sharded model (FSDP2's ``register_fsdp_forward_method``) has the LM head's
        weight gathered for the whole call.

        Args:
            input_ids, positions, attn_mask: as :meth:`hidden_dense` (``[B, T]``, ``[B, T]``, ``[B, T, T]``).
            rows, columns, targets: int64 ``[N]``: the row and position of each prediction, and its token.
            chunk: tokens of the LM head at a time (0: the whole ``[N, vocab_size]`` at once).
        """
        hidden = self.hidden_dense(input_ids, positions, attn_mask)  # [B, T, hidden]
        return head_logprobs(hidden[rows, columns], self.lm_head_weight, targets, chunk)  # [N]

    def hidden_dense(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """Differentiable dense forward for training with an explicit attention pattern: the final
        normed hidden states (what the LM head reads, :meth:`lm_head_weight`).

        The pattern is free, so one row may hold several sequences that share a prefix (a GRPO
        group packed as prompt + its n responses, each response attending to the prompt and to
        itself: ``rl/grpo_step.py``); ``positions`` gives each token its RoPE position.

        Args:
            input_ids: int64 ``[B, T]``.
            positions: int64 ``[B, T]`` RoPE positions.
            attn_mask: bool ``[B, T, T]``, True where query i may attend to key j. The diagonal is
                opened here, so a padding query never has an empty row (NaN through softmax).

        Returns:
            ``[B, T, hidden_size]`` in the model's dtype.
        """
        b, t = input_ids.shape
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = self.rotary.cos_sin(positions.flatten(), x.dtype)  # [B*T, 1, D]
        cos, sin = cos.view(b, t, 1, -1), sin.view(b, t, 1, -1)  # [B, T, 1, D]
        mask = (attn_mask | torch.eye(t, dtype=torch.bool, device=attn_mask.device))[:, None]  # [B, 1, T, T]
        for layer in self.model.layers:
            x = layer.forward_dense(x, cos, sin, mask)
        return self.model.norm(x)
