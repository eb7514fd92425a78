"""Triton RoPE of q and k in one launch, with Qwen3's per-head RMSNorm fused in front when asked, and
the KV cache write of the rotated k and of v fused behind it when asked (`store`).

One program per token: it reads the token's cos/sin row once (float32 table) and rotates every head of
q and of k, writing new contiguous tensors (q and k usually arrive as strided views of the fused qkv
projection). Each multiply and add is rounded to the activation dtype where a torch op on that dtype
would round it (`reference.rope`), so bf16 results match the torch path bit for bit except where the
float32 sum of a norm lands differently. Into an FP8 cache (`store.quant`) the stored k and v are
quantized (`_round.to_e4m3`), as `store_kv` would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._checks import check_store
from shared.kernels._launch import next_pow2
from shared.kernels._norm_checks import (
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
from shared.kernels._round import round_to, rounding_options, to_e4m3
from shared.kernels.kv_store import KVStore


@triton.jit
def _rotate_heads(
    src, dst, w_ptr, stride_src_h, stride_dst_h, cos, sin, eps, cache, stride_cache_h, cache_ok, inv_scale,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, STORE: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Rotate every head of one token from `src` into `dst`; with STORE also into the cache row `cache`
    (where `cache_ok`: a row whose store index is negative is skipped), with QUANT quantized to FP8."""
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
    if STORE:
        keep = mask & cache_ok
        if QUANT:
            c1 = to_e4m3(o1, inv_scale, cache.dtype.element_ty)
            c2 = to_e4m3(o2, inv_scale, cache.dtype.element_ty)
        else:
            c1, c2 = o1.to(cache.dtype.element_ty), o2.to(cache.dtype.element_ty)
        tl.store(cache + h * stride_cache_h + j, c1, mask=keep)
        tl.store(cache + h * stride_cache_h + HALF + j, c2, mask=keep)


@triton.jit
def _copy_heads(
    src, dst, stride_src_h, stride_dst_h, ok, inv_scale,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HEADS) & (d < HEAD_DIM) & ok
    x = tl.load(src + h * stride_src_h + d, mask=mask)
    if QUANT:
        x = to_e4m3(x.to(tl.float32), inv_scale, dst.dtype.element_ty)
    tl.store(dst + h * stride_dst_h + d, x, mask=mask)


# positions and the store index are views into one packed int64 buffer at offsets that move with the
# batch; read one value a program, they gain nothing from alignment, and specializing on it would
# compile a new kernel mid-traffic.
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "idx_ptr"])
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, v_ptr, kd_ptr, vd_ptr, idx_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    stride_vt, stride_vh, stride_kds, stride_kdh, stride_vds, stride_vdh,
    num_positions, eps, inv_k, inv_v,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
    STORE: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    dst = tl.zeros([1, 1], tl.int64)
    if STORE:  # the token's cache row; negative: padding or a skipped token, nothing stored
        dst += tl.load(idx_ptr + t).to(tl.int64)
    cache_ok = dst >= 0
    row = tl.maximum(dst, 0)
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
        qo_ptr, 0, cache_ok, inv_k, HQ, HALF, BLOCK_HQ, BLOCK_HALF, NORM, False, False,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + t * stride_kt, ko_ptr + t * stride_kot, kw_ptr, stride_kh, stride_koh, cos, sin, eps,
        kd_ptr + row * stride_kds, stride_kdh, cache_ok, inv_k, HKV, HALF, BLOCK_HKV, BLOCK_HALF, NORM, STORE,
        QUANT,
    )  # fmt: skip
    if STORE:
        _copy_heads(
            v_ptr + t * stride_vt, vd_ptr + row * stride_vds, stride_vh, stride_vdh, cache_ok, inv_v,
            HKV, 2 * HALF, BLOCK_HKV, BLOCK_D, QUANT,
        )  # fmt: skip


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    *,
    store: KVStore | None = None,
    v: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.rope`: q [T, Hq, D] and k [T, Hkv, D] (rows and heads may be
    strided), positions [T] int, cos_sin [P, D] float (cos half | sin half); optional per-head norm
    weights [D]. Returns new contiguous (q, k).

    With `store` (and `v` [T, Hkv, D]), the same launch also writes the rotated k and v into the cache
    rows `store` names, as `shared/kernels/attention/store_kv.py` would: the KV store costs no kernel
    of its own."""
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
    if store is not None:
        if v is None or v.shape != k.shape or v.dtype != k.dtype:
            fail(op, f"storing K/V needs v shaped like k {tuple(k.shape)} {k.dtype}")
        check_store(op, k, v, store.k_dst, store.v_dst, store.index, store.quant)
        check_same_device(op, q=q, v=v, k_dst=store.k_dst, v_dst=store.v_dst, index=store.index)
        for name, t in (("v", v), ("k_dst", store.k_dst), ("v_dst", store.v_dst)):
            if t.stride(-1) != 1:
                fail(op, f"{name} must have a contiguous last dim")
    quant = store.quant if store is not None else None
    q_out = torch.empty((tokens, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k.shape[1], d), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half, block_hq, block_hkv = d // 2, next_pow2(hq), next_pow2(k.shape[1])
    block_half = next_pow2(half)
    qw = q_weight if q_weight is not None else q_out  # unread when NORM=False
    kw = k_weight if k_weight is not None else k_out
    # Unread when STORE=False: any tensors of the right kind stand in.
    vv, kd, vd, idx = (
        (v, store.k_dst, store.v_dst, store.index)
        if store is not None and v is not None
        else (k_out, k_out, k_out, positions)
    )
    _rope_kernel[(tokens,)](
        q, k, q_out, k_out, positions, cos_sin, qw, kw, vv, kd, vd, idx,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        vv.stride(0), vv.stride(1), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1),
        cos_sin.shape[0], float(eps), *((quant.inv_k, quant.inv_v) if quant is not None else (1.0, 1.0)),
        HQ=hq, HKV=k.shape[1], HALF=half, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        BLOCK_D=next_pow2(d), NORM=norm, STORE=store is not None, QUANT=quant is not None,
        num_warps=4 if block_hq * block_half <= 2048 else 8, **rounding_options(q.dtype),
    )  # fmt: skip
    return q_out, k_out
