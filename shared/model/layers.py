"""Building blocks of the decoder: RMSNorm, rotary embedding tables, the gated MLP (SwiGLU, GeGLU).

Numerics follow Hugging Face's Llama family (norm in float32, RoPE tables in float32, cast to the
activation dtype) so that parity tests can hold a tight tolerance. The modules hold weights; the math
is a `ModelKernels` the caller passes (fused Triton on CUDA), torch's reference when none is given.

A Gemma norm, x * (1 + w), is an RMSNorm whose weight is loaded as 1 + w (`Transformer.load_weights`),
so that every kernel, the fused q/k norm and the folding of norms into GEMMs take it as they are. In
float32 that is Gemma's norm exactly; in bfloat16 the normed row is rounded before the weight
multiplies it (Llama's order) where Gemma rounds once after: the two differ by the dtype's rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shared.kernels import KVStore, ModelKernels, kernels_for
from shared.model.config import ModelConfig, RopeScaling

_TORCH = kernels_for("cpu", "torch")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, kernels: ModelKernels = _TORCH) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies; llama3 scaling slows long wavelengths by `factor`, with a smooth ramp between;
    linear scaling slows them all by `factor`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
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


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn more than `beta_fast` times over the original context keep their
    value, those under `beta_slow` turns are divided by `factor`, and a linear ramp joins the two."""

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (
            head_dim
            * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    interpolated = 1.0 / (s.factor * (1.0 / inv_freq))  # Hugging Face's 1 / (factor * theta^(2i/d))
    return interpolated * (1 - extrapolated) + inv_freq * extrapolated


@dataclass(frozen=True)
class RopeArgs:
    """What `Rotary` would do to q and k, for an attention that applies RoPE itself
    (`AttentionFn.takes_rope`): positions [T], the cos/sin table, Qwen3's per-head norm weights."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0
    # The layer's input, when q, k and v come from a GEMM of it rather than of its norm
    # (`Transformer.fold_norms`): they are scaled by its rows' rsqrt(mean(x^2) + rms_eps) first.
    rms_x: torch.Tensor | None = None
    rms_eps: float = 0.0


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, gathered by position.

    A table lookup (rather than computing per step) keeps the forward free of shape-dependent work, so
    a decode step can be captured in a CUDA graph. A model whose local layers rotate with a base of
    their own (Gemma 3: `rope_local_theta`) has a second table, `cos_sin_local`, that those layers read
    (`local=True`).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.theta = cfg.rope_theta
        self.scaling = cfg.rope_scaling
        self.local_theta = cfg.rope_local_theta
        self.max_positions = cfg.max_position_embeddings
        self.register_buffer("cos_sin", self._table(device, self.theta, self.scaling), persistent=False)
        self.register_buffer("cos_sin_local", self._local_table(device), persistent=False)

    def _table(
        self, device: torch.device | str | None, theta: float, scaling: RopeScaling | None
    ) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, theta, scaling).to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D] float32: cos half | sin half
        if scaling is not None and scaling.attention_factor != 1.0:
            table = table * scaling.attention_factor  # YaRN: q and k scaled with the rotation
        return table

    def _local_table(self, device: torch.device | str | None) -> torch.Tensor | None:
        return None if self.local_theta is None else self._table(device, self.local_theta, None)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the tables (after a model was materialized from the meta device)."""
        self.cos_sin = self._table(device, self.theta, self.scaling)
        self.cos_sin_local = self._local_table(device)

    def table(self, local: bool = False) -> torch.Tensor:
        """The cos/sin table of a layer: the local layers' (`local`), where the model has one."""
        return self.cos_sin_local if local and self.cos_sin_local is not None else self.cos_sin

    def args(
        self, positions: torch.Tensor, qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
        rms: tuple[torch.Tensor, float] | None = None, local: bool = False,
    ) -> RopeArgs:  # fmt: skip
        """RoPE of `positions` (and the q/k norm) for an attention that applies it itself; `rms` is
        the layer's input and its norm's eps when q, k and v are to be scaled by it (RopeArgs.rms_x)."""
        rx, reps = rms if rms is not None else (None, 0.0)
        if qk_norm is None:
            return RopeArgs(positions, self.table(local), rms_x=rx, rms_eps=reps)
        q_norm, k_norm = qk_norm
        return RopeArgs(positions, self.table(local), q_norm.weight, k_norm.weight, q_norm.eps, rx, reps)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        kernels: ModelKernels = _TORCH,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
        *,
        store: KVStore | None = None,
        v: torch.Tensor | None = None,
        local: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated to `positions`; with `qk_norm` (Qwen3's q_norm and k_norm)
        each head is normed first, in the same kernel. With `store`, the rotated k and `v` are also
        written into the KV cache rows it names, still in the same kernel. `local`: with the local
        layers' table (`table`)."""
        norm: tuple[torch.Tensor, torch.Tensor, float] | tuple[()] = ()
        if qk_norm is not None:
            norm = (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        if store is None:
            return kernels.rope(q, k, positions, self.table(local), *norm)
        if v is None:
            raise ValueError("Rotary: storing K/V needs v")
        return kernels.rope_store(q, k, v, positions, self.table(local), store, *norm)


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul: act is silu (SwiGLU), or
    GELU's tanh approximation (`activation="gelu_tanh"`: Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate = intermediate
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        # Tensor parallel (shared/model/tensor_parallel.py): the all-reduce of the rank's partial down
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, kernels: ModelKernels = _TORCH, rms_eps: float | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """With `rms_eps`, x is the residual stream itself, not its norm: gate_up's weight holds the
        norm's weight (`Transformer.fold_norms`) and the activation applies each row's
        rsqrt(mean(x^2) + eps), which commutes with the GEMM. With `residual` (which the call
        consumes), residual + the output, the add inside the down projection's GEMM."""
        gate_up = kernels.linear(x, self.gate_up_proj)
        gelu = self.activation == "gelu_tanh"
        if rms_eps is None:
            act = kernels.glu(gate_up, gelu, self.down_proj)
        else:
            act = (kernels.gelu_tanh_mul_rms if gelu else kernels.silu_mul_rms)(gate_up, x, rms_eps)
        if self.reduce is not None:  # tensor parallel: this rank's slice's share, summed over the ranks
            out = self.reduce(kernels.linear(act, self.down_proj))
            return out if residual is None else residual + out
        if residual is not None:
            return kernels.linear_add(act, self.down_proj, residual)
        return kernels.linear(act, self.down_proj)
