"""Triton RoPE of q and k in one launch, with Qwen3's per-head RMSNorm fused in front when asked.

One program per token: it reads the token's cos/sin row once (float32 table) and rotates every head of
q and of k, writing new contiguous tensors (q and k usually arrive as strided views of the fused qkv
projection). Each multiply and add is rounded to the activation dtype where a torch op on that dtype
would round it (`reference.rope`), so bf16 results match the torch path bit for bit except where the
float32 sum of a norm lands differently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.attention._launch import next_pow2
from shared.model.kernels._checks import (
    FLOAT_DTYPES,
    check_activation,
    check_dims,
    check_dtype,
    check_eps,
    check_same_device,
    check_triton_device,
    check_weight,
    fail,
)
from shared.model.kernels._round import round_to


@triton.jit
def _rotate_heads(
    src, dst, w_ptr, stride_src_h, stride_dst_h, cos, sin, eps,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < HEADS) & (j < HALF)
    dtype = dst.dtype.element_ty
    x1 = tl.load(src + h * stride_src_h + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * stride_src_h + HALF + j, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        rstd = rstd[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        x1 = round_to(round_to(x1 * rstd, dtype) * w1, dtype)
        x2 = round_to(round_to(x2 * rstd, dtype) * w2, dtype)
    c = round_to(cos, dtype)
    s = round_to(sin, dtype)
    o1 = round_to(round_to(x1 * c, dtype) - round_to(x2 * s, dtype), dtype)
    o2 = round_to(round_to(x2 * c, dtype) + round_to(x1 * s, dtype), dtype)
    tl.store(dst + h * stride_dst_h + j, o1.to(dtype), mask=mask)
    tl.store(dst + h * stride_dst_h + HALF + j, o2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    num_positions, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # Negative positions wrap as torch indexing does (CUDA-graph padding rows carry -1); anything still
    # outside the table is clamped so that a bad position can never read out of bounds.
    pos = tl.where(pos < 0, pos + num_positions, pos)
    pos = tl.minimum(tl.maximum(pos, 0), num_positions - 1)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + t * stride_qt, qo_ptr + t * stride_qot, qw_ptr, stride_qh, stride_qoh, cos, sin, eps,
        HQ, HALF, BLOCK_HQ, BLOCK_HALF, NORM,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + t * stride_kt, ko_ptr + t * stride_kot, kw_ptr, stride_kh, stride_koh, cos, sin, eps,
        HKV, HALF, BLOCK_HKV, BLOCK_HALF, NORM,
    )  # fmt: skip


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.rope`: q [T, Hq, D] and k [T, Hkv, D] (rows and heads may be
    strided), positions [T] int, cos_sin [P, D] float (cos half | sin half); optional per-head norm
    weights [D]. Returns new contiguous (q, k)."""
    op = "rope"
    check_activation(op, "q", q, 3, "[T, Hq, D]")
    check_activation(op, "k", k, 3, "[T, Hkv, D]")
    check_dims(op, "positions", positions, 1, "[T]")
    check_dtype(op, "positions", positions, (torch.int64, torch.int32))
    check_dims(op, "cos_sin", cos_sin, 2, "[P, D]")
    check_dtype(op, "cos_sin", cos_sin, FLOAT_DTYPES)
    tokens, hq, d = q.shape
    if k.shape[0] != tokens or k.shape[2] != d:
        fail(op, f"k {tuple(k.shape)} must be [T, Hkv, D] with q's T = {tokens} and D = {d}")
    if k.dtype != q.dtype:
        fail(op, f"k dtype {k.dtype} != q dtype {q.dtype}")
    if positions.shape[0] != tokens:
        fail(op, f"positions has {positions.shape[0]} entries, expected T = {tokens}")
    if d % 2:
        fail(op, f"head dim must be even, got {d}")
    if cos_sin.shape[1] != d or cos_sin.stride(1) != 1 or cos_sin.shape[0] < 1:
        fail(op, f"cos_sin must be [P >= 1, D = {d}] with a contiguous last dim, got {tuple(cos_sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        fail(op, "pass both q_weight and k_weight (per-head norm) or neither")
    norm = q_weight is not None and k_weight is not None
    if norm:
        check_weight(op, "q_weight", q_weight, d, q.dtype)
        check_weight(op, "k_weight", k_weight, d, q.dtype)
        check_eps(op, eps)
    weights = {"q_weight": q_weight, "k_weight": k_weight} if norm else {}
    check_same_device(op, q=q, k=k, positions=positions, cos_sin=cos_sin, **weights)
    check_triton_device(op, q.device)
    q_out = torch.empty((tokens, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k.shape[1], d), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half, block_hq, block_hkv = d // 2, next_pow2(hq), next_pow2(k.shape[1])
    block_half = next_pow2(half)
    qw = q_weight if q_weight is not None else q_out  # unread when NORM=False
    kw = k_weight if k_weight is not None else k_out
    _rope_kernel[(tokens,)](
        q, k, q_out, k_out, positions, cos_sin, qw, kw,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), cos_sin.stride(0), cos_sin.shape[0], float(eps),
        HQ=hq, HKV=k.shape[1], HALF=half, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        NORM=norm, num_warps=4 if block_hq * block_half <= 2048 else 8,
    )  # fmt: skip
    return q_out, k_out
