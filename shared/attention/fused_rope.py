"""RoPE (and Qwen3's per-head q/k norm) applied by a decode attention kernel, with the K/V store.

In a decode step a layer's RoPE kernel does little work for one graph node of its own: rotate one
token's heads and write its K/V into the cache. The attention kernels can do that work themselves:
each program already loads its query rows, and the program that reads the chunk's key (the last
split of a (sequence, kv head)) rotates it, stores it and its v, and attends to it from registers.
One node fewer per layer. The rotated values match the RoPE kernel (`shared/model/kernels/rope.py`):
the same roundings in the same order. Queries and keys are handled as their two column halves (a
rotation pairs column j with j + D/2), and scores sum the halves' products (`attend_block(HALVES)`).

Decode-shaped calls only (every chunk one token, `max_q == 1`): a longer chunk's keys would be read by
several query tiles, and each would store them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.attention._checks import check_dims, check_dtype, check_same_device, check_store, fail
from shared.attention._launch import next_pow2
from shared.model.kernels._round import round_to


@dataclass(frozen=True)
class RopeInKernel:
    """What RoPE would do to q and k, and where the rotated k and v go.

    positions [T] int (a token's position; negative ones wrap, as in the RoPE kernel), cos_sin [P, D]
    float (cos half | sin half), optional per-head norm weights [D] with eps, and the store: k_dst /
    v_dst [S, Hkv, D] (a cache viewed flat) at store_index [T] int64 (negative: not stored).
    """

    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_dst: torch.Tensor
    v_dst: torch.Tensor
    store_index: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0

    @property
    def norm(self) -> bool:
        return self.q_weight is not None


def check_rope_in_kernel(
    op: str,
    rope: RopeInKernel,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    max_q: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every argument check of RoPE inside attention; returns the chunk's (k_new, v_new)."""
    if k_new is None or v_new is None:
        fail(op, "RoPE inside attention needs the chunk's k_new and v_new")
    if max_q != 1:
        fail(op, f"RoPE inside attention takes decode-shaped calls only (max_q == 1), got max_q={max_q}")
    tokens, d = q.shape[0], q.shape[2]
    check_dims(op, "rope.positions", rope.positions, 1, "[T]")
    check_dtype(op, "rope.positions", rope.positions, (torch.int64, torch.int32))
    if rope.positions.shape[0] != tokens:
        fail(op, f"rope.positions has {rope.positions.shape[0]} entries, expected T = {tokens}")
    check_dims(op, "rope.cos_sin", rope.cos_sin, 2, "[P, D]")
    if rope.cos_sin.shape[1] != d or rope.cos_sin.stride(1) != 1 or rope.cos_sin.shape[0] < 1:
        shape = tuple(rope.cos_sin.shape)
        fail(op, f"rope.cos_sin must be [P >= 1, D = {d}], last dim contiguous, got {shape}")
    if d % 2:
        fail(op, f"RoPE needs an even head dim, got {d}")
    if (rope.q_weight is None) != (rope.k_weight is None):
        fail(op, "pass both rope.q_weight and rope.k_weight (per-head norm) or neither")
    for name, w in (("rope.q_weight", rope.q_weight), ("rope.k_weight", rope.k_weight)):
        if w is not None and (w.shape != (d,) or w.stride(0) != 1):
            fail(op, f"{name} must be a contiguous [{d}] tensor, got {tuple(w.shape)}")
    check_store(op, k_new, v_new, rope.k_dst, rope.v_dst, rope.store_index)
    for name, t in (("rope.k_dst", rope.k_dst), ("rope.v_dst", rope.v_dst)):
        if t.stride(-1) != 1:
            fail(op, f"{name} must have a contiguous last dim")
    weights = {"q_weight": rope.q_weight, "k_weight": rope.k_weight} if rope.norm else {}
    check_same_device(op, q=q, positions=rope.positions, cos_sin=rope.cos_sin, **weights)
    return k_new, v_new


def kernel_args(rope: RopeInKernel | None, q: torch.Tensor, k_new: torch.Tensor) -> tuple:
    """The kernels' RoPE arguments, in order (stand-ins, never read, without `rope`)."""
    if rope is None:
        return (q, q, q, q, q, k_new, k_new, 0, 0, 0, 0, 0, 1, 0.0)
    qw = rope.q_weight if rope.q_weight is not None else q
    kw = rope.k_weight if rope.k_weight is not None else q
    kd, vd = rope.k_dst, rope.v_dst
    return (
        rope.positions, rope.cos_sin, qw, kw, rope.store_index, kd, vd, rope.cos_sin.stride(0),
        kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1), rope.cos_sin.shape[0], float(rope.eps),
    )  # fmt: skip


def block_half(head_dim: int) -> int:
    """The column tile of one half of a head: a power of two, at least tl.dot's 16."""
    return max(16, next_pow2(head_dim // 2))


@triton.jit
def rotated_halves(
    base, row_ok, tok, pos_ptr, cs_ptr, stride_cs, num_positions, w_ptr, eps,
    BLOCK_HALF: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """Rows `base[r] + d` ([R] pointers to heads), normed (NORM, weights `w_ptr`) and rotated to
    positions[tok[r]], as two [R, BLOCK_HALF] halves in base's dtype (columns >= HEAD_DIM / 2 are 0).

    Halves, not one [R, D] tile: a rotation pairs column j with j + D/2, and gathering a column's
    partner within one tile goes through shared memory (measured: twice the kernel's shared memory,
    half the programs an SM holds). Each step is the RoPE kernel's `_rotate_heads`, rounding included.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = base.dtype.element_ty
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    mask = row_ok[:, None] & j_ok[None, :]
    x1 = tl.load(base[:, None] + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base[:, None] + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        rstd = rstd[:, None]
        w1 = tl.load(w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        x1 = round_to(round_to(x1 * rstd, dtype) * w1, dtype)
        x2 = round_to(round_to(x2 * rstd, dtype) * w2, dtype)
    # As the RoPE kernel: negative positions wrap (graph padding rows carry -1), the rest is clamped.
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int64)
    pos = tl.where(pos < 0, pos + num_positions, pos)
    pos = tl.minimum(tl.maximum(pos, 0), num_positions - 1)
    cs_row = cs_ptr + pos[:, None] * stride_cs
    c = round_to(tl.load(cs_row + j[None, :], mask=mask, other=0.0).to(tl.float32), dtype)
    s = round_to(tl.load(cs_row + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32), dtype)
    o1 = round_to(round_to(x1 * c, dtype) - round_to(x2 * s, dtype), dtype)
    o2 = round_to(round_to(x2 * c, dtype) + round_to(x1 * s, dtype), dtype)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def key_halves(rows, ok, BLOCK_HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Keys at `rows[n] + d` ([N] pointers) as two [N, BLOCK_HALF] halves (to meet halved queries)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, BLOCK_HALF)
    mask = ok[:, None] & (j < HALF)[None, :]
    k1 = tl.load(rows[:, None] + j[None, :], mask=mask, other=0.0)
    k2 = tl.load(rows[:, None] + HALF + j[None, :], mask=mask, other=0.0)
    return k1, k2


@triton.jit
def rope_chunk_keys(
    kn_ptr, vn_ptr, jt, j_ok, kvh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    pos_ptr, cs_ptr, stride_cs, num_positions, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr,
    stride_kds, stride_kdh, stride_vds, stride_vdh,
    BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """The chunk's keys `jt` ([N] token ids, valid where j_ok) of kv head `kvh`: k rotated (two
    halves), v as is; both stored at idx[jt] of the flat caches (negative index: not stored).
    Returns (k1, k2, v)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    k1, k2 = rotated_halves(
        kn_ptr + jt * stride_knt + kvh * stride_knh, j_ok, jt, pos_ptr, cs_ptr, stride_cs, num_positions,
        kw_ptr, eps, BLOCK_HALF, HEAD_DIM, NORM,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    mask = j_ok[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(vn_ptr + (jt * stride_vnt + kvh * stride_vnh)[:, None] + d[None, :], mask=mask, other=0.0)
    dst = tl.load(idx_ptr + jt, mask=j_ok, other=-1).to(tl.int64)
    keep = j_ok & (dst >= 0)
    row = tl.maximum(dst, 0)
    j = tl.arange(0, BLOCK_HALF)
    half_keep = keep[:, None] & (j < HALF)[None, :]
    k_dst = kd_ptr + (row * stride_kds + kvh * stride_kdh)[:, None] + j[None, :]
    tl.store(k_dst, k1, mask=half_keep)
    tl.store(k_dst + HALF, k2, mask=half_keep)
    tl.store(
        vd_ptr + (row * stride_vds + kvh * stride_vdh)[:, None] + d[None, :], v, mask=keep[:, None] & mask
    )
    return k1, k2, v
