"""Building blocks of the decoder: RMSNorm, rotary embedding tables, SwiGLU MLP.

Numerics follow Hugging Face's Llama family (norm in float32, RoPE tables in float32, cast to the
activation dtype) so that parity tests can hold a tight tolerance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies; llama3 scaling slows long wavelengths by `factor`, with a smooth ramp between."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, gathered by position.

    A table lookup (rather than computing per step) keeps the forward free of shape-dependent work, so
    a decode step can be captured in a CUDA graph.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.theta = cfg.rope_theta
        self.scaling = cfg.rope_scaling
        self.max_positions = cfg.max_position_embeddings
        self.register_buffer("cos_sin", self._table(device), persistent=False)

    def _table(self, device: torch.device | str | None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D] float32: cos half | sin half

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the table (after a model was materialized from the meta device)."""
        self.cos_sin = self._table(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Hugging Face's rotate_half convention: the two halves of a head are the (real, imag) pair.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
