"""Torch versions of the decoder's elementwise ops: the CPU path, and what the Triton kernels match.

Every op rounds to the activation dtype exactly where Hugging Face's Llama family does (each torch op on
a bf16 tensor rounds its result), so the fused kernels can reproduce these results to the bit, up to
the order of a float32 sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm over the last dim: weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, H, D] with cos/sin [T, 1, D/2] (Hugging Face's rotate_half: the two halves of a
    head are the real and imaginary parts). Tables are rounded to x's dtype first, as HF does."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated by the rows `positions` [T] of cos_sin [P, D] (cos half |
    sin half). With q_weight and k_weight (Qwen3), each head is RMS-normed first."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    return rotate(q, cos, sin), rotate(k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from gate_up [T, 2I] (gate | up, one fused projection's output) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up from gate_up [T, 2I] -> [T, I]: Gemma's GeGLU (transformers'
    gelu_pytorch_tanh, torch's GELU with the tanh approximation)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rms_scale(y: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """y's rows times rsqrt(mean(x_f32^2) + eps) of x's rows, rounded to y's dtype: what a GEMM of
    norm(x) gives when it read x and its weight holds the norm's weight (`Transformer.fold_norms`)."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.float() * rstd).to(y.dtype)


def silu_mul_rms(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """`silu_mul` of gate_up's rows scaled by rsqrt(mean(x_f32^2) + eps) of x's rows, rounded to the
    dtype first: the MLP of a layer whose post-attention RMSNorm weight sits in gate_up's weight
    (`Transformer.fold_norms`), so that the GEMM could read x itself rather than its norm."""
    return silu_mul(rms_scale(gate_up, x, eps))


def gelu_tanh_mul_rms(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """`gelu_tanh_mul` after the row scale of a folded norm, as `silu_mul_rms`."""
    return gelu_tanh_mul(rms_scale(gate_up, x, eps))
