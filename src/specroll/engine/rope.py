"""Rotary position embedding (RoPE), shared by the paged inference path and the dense training path."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """RoPE in the rotate-half convention (Su et al. 2021; Hugging Face's ``rotate_half``).

    ``inv_freq[i] = theta^(-2i/D)``; position p rotates the pair (x_i, x_{i+D/2}) by
    ``p * inv_freq[i]``. Computed in float32 as Hugging Face does, so logits match it.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [D/2] float32
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and the signed ``sin`` that :func:`apply_rope` takes, ``[T, 1, D]`` each, for int64
        ``positions`` ``[T]``, on ``positions``' device.

        ``cos = [cos θ, cos θ]`` and ``sin = [−sin θ, sin θ]`` over the two halves (θ ``[T, D/2]``):
        the sign of ``rotate_half`` is carried by the table, so applying RoPE takes no negation.
        """
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., H, D]`` by the angles in ``cos``/``sin`` from :meth:`RotaryEmbedding.cos_sin`
    (broadcastable to ``x``): ``x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = [−x₂, x₁]``,
    computed as ``x·cos + [x₂, x₁]·[−sin, sin]`` (the sign is in the table): bit for bit Hugging
    Face's products and sum (``(−a)·b == a·(−b)`` in IEEE arithmetic), one op fewer. Not ``addcmul``:
    its fused rounding moved a 2-rank trainer's weights 20x further from a 1-rank one's."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
