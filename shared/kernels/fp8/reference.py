"""FP8 (e4m3) weights and activations in torch: the CPU path, and what the Triton kernels and cuBLAS's
scaled GEMMs are tested against.

Scales are float32 multipliers that dequantize (`value = e4m3 * scale`, Hugging Face's
`weight_scale_inv`), one per block of a weight and one per group of an activation row:

- weights [N, K]: one scale per (bn, bk) block, `scale` [ceil(N / bn), ceil(K / bk)]. (1, K) is one scale
  per output channel; (128, 128) the block scales FP8 checkpoints ship; (1, 128) a row's 128-column
  groups (a fused projection whose parts do not start on a 128-row boundary).
- activations [T, K]: one scale per token and per `group` columns, computed on the fly from the group's
  absolute maximum (`quantize`), the group being the weight's bk (the whole row for per-channel weights).

Quantizing is `saturate(x * (1 / scale))` rounded to nearest-even in e4m3, with scale = amax / 448: the
group's largest value lands on 448 exactly. Every division is IEEE float32, here and in the kernels
(`tl.math.div_rn`), so the Triton quantizers give these bits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from shared.kernels import reference

__all__ = [
    "E4M3", "FP8_MAX", "Fp8Act", "dequantize", "dequantize_act", "gemm", "glu_quant", "quantize",
    "quantize_weight", "rms_norm_quant",
]  # fmt: skip

E4M3 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(E4M3).max)  # 448
# The smallest absolute maximum a scale is taken from: an all-zero group gets a tiny scale (and zeros),
# never a division by zero.
AMAX_FLOOR = 1e-12


class Fp8Act(NamedTuple):
    """An activation quantized for an FP8 GEMM: data [T, K] e4m3 and scale [T, ceil(K / group)] float32
    (column-major from the Triton quantizers, as cuBLAS's 1x128 scaling reads it); `dtype` is the
    activation's own dtype, the GEMM's output dtype."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _groups(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """x [N, K] as float32 blocks [Nb, bn, Kb, bk], zero-padded at the ends."""
    n, k = x.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(x.float(), (0, kb * bk - k, 0, nb * bn - n))
    return padded.view(nb, bn, kb, bk)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # A tensor divisor: CUDA torch multiplies by the reciprocal of a Python scalar divisor, which is
    # off by an ulp now and then; IEEE division gives the same bits on every device and in the kernels.
    return amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def quantize_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale [ceil(N / bn), ceil(K / bk)] float32), one scale per block."""
    n, k = w.shape
    bn, bk = block
    g = _groups(w, bn, bk)
    scale = _scale_of(g.abs().amax(dim=(1, 3)))
    q = _to_e4m3(g, scale[:, None, :, None])
    return q.view(scale.shape[0] * bn, scale.shape[1] * bk)[:n, :k].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An e4m3 weight [N, K] with its block scales -> float32 [N, K]."""
    n, k = q.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * full


def quantize(x: torch.Tensor, group: int) -> Fp8Act:
    """x [T, K] -> Fp8Act: each token's `group`-column groups scaled to their absolute maximum (the whole
    row when group >= K)."""
    t, k = x.shape
    group = min(group, k) if k else group
    g = _groups(x, 1, max(group, 1))
    scale = _scale_of(g.abs().amax(dim=(1, 3)))
    q = _to_e4m3(g, scale[:, None, :, None]).view(t, -1)[:, :k]
    return Fp8Act(q.contiguous(), scale, group, x.dtype)


def dequantize_act(a: Fp8Act) -> torch.Tensor:
    """An Fp8Act back to float32 [T, K]."""
    return dequantize(a.data, a.scale, (1, a.group))


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int) -> Fp8Act:
    """`reference.rms_norm` (rounded to x's dtype, as a layer's norm gives it), then `quantize`."""
    return quantize(reference.rms_norm(x, weight, eps), group)


def glu_quant(gate_up: torch.Tensor, group: int, gelu: bool = False) -> Fp8Act:
    """`reference.silu_mul` (gelu: `gelu_tanh_mul`), rounded as the layer's activation gives it, then
    `quantize`: the down projection's FP8 input."""
    act = reference.gelu_tanh_mul(gate_up) if gelu else reference.silu_mul(gate_up)
    return quantize(act, group)


def gemm(
    a: Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """a @ dequantize(weight)^T (+ bias) (+ residual) in float32, rounded once to a's dtype: what an FP8
    GEMM with float32 accumulation computes (up to the order of its sums)."""
    out = dequantize_act(a) @ dequantize(weight, scale, block).t()
    if bias is not None:
        out = out + bias.float()
    if residual is not None:
        out = out + residual.float()
    return out.to(a.dtype)
