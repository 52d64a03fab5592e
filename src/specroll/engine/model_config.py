"""Architecture hyper-parameters of a Llama-family decoder.

One struct describes Llama/SmolLM2, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm); the
loaders in ``loaders/checkpoint.py`` (Hugging Face directories) and ``loaders/gguf.py`` (GGUF
files) fill it from a checkpoint and validate it at that boundary. It lives beside the model, not
with the loaders: the model, the attention backends and the runner are built from it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Architecture = Literal["llama", "qwen2", "qwen3"]


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape and numerics of one decoder-only checkpoint.

    Weight names follow Hugging Face's Llama layout (``model.layers.{i}.self_attn.q_proj.weight``
    and so on); every loader converts to those names.
    """

    architecture: Architecture
    """Which family: ``llama`` (Llama, SmolLM2), ``qwen2`` (q/k/v bias) or ``qwen3`` (q/k norm)."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA: ``num_heads`` must be a multiple of it)."""
    head_dim: int
    """Width of one attention head."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm, read from the checkpoint."""
    rope_theta: float
    """RoPE base frequency, read from the checkpoint (never a library default)."""
    max_position_embeddings: int
    """Context length in tokens: prompt + response never pass it."""
    tie_word_embeddings: bool
    """The LM head reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2; Llama's ``attention_bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the checkpoint names one."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a generation."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"model config: {name}={value}, expected a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim={self.head_dim}, expected an even number for RoPE")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(
                f"model config: rope_theta={self.rope_theta}, rms_norm_eps={self.rms_norm_eps}, "
                "expected positive numbers"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per byte of element size."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim


SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
)
"""The default model's shapes, as its GGUF states them: random-weight stand-ins at real size
(``loaders.checkpoint.random_checkpoint``) where the file is not at hand, e.g. on a GPU machine."""


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor a model with ``config`` needs, in Hugging Face Llama naming.

    ``lm_head.weight`` is listed only when embeddings are not tied; q/k/v biases only with
    ``attention_bias``; per-head q/k norms only with ``qk_norm``.
    """
    hidden, head_dim = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_rows)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
