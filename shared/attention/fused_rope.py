"""RoPE (and Qwen3's per-head q/k norm) applied by a decode attention kernel, with the K/V store.

In a decode step a layer's RoPE kernel does little work for one graph node of its own: rotate one
token's heads and write its K/V into the cache. The attention kernels can do that work themselves:
each program already loads its query rows, and the program that reads the chunk's key (the last
split of a (sequence, kv head)) rotates it, stores it and its v, and attends to it from registers.
One node fewer per layer. The rotated values match the RoPE kernel (`shared/model/kernels/rope.py`):
the same roundings in the same order.

The attention loop stays the plain kernel's. Only the rows that hold data are rotated, as a small tile
of their own (a decode tile of 16 rows holds 2 query rows and 1 key): rotating the padded tile took
145-168 registers a program against 92-128, and an SM held 3 programs instead of 4, so the 512
programs of a batch-64 step no longer fit one wave (H200: paged 64 us against 46). The rotated query
rows go to the program's own output rows and, after a barrier, the kernel loads them back as the
plain kernel loads its tile. Each column's rotation partner is loaded from memory a second time, in
the tile's own layout (`rotated_rows`).

The token's key is rotated and stored for the steps after (its v too) before the loop. Ring attention
then attends to it from registers (`chunk_key`, `_online_softmax.fold_key`) where it used to read it
back after pass 1 in a one-key block of its own, a chain of dependent loads at the end of every
program (ring 40.1 us against 41.5 on an H200, docs/benchmarks.md). Paged attention reads it back
from its page after a barrier, with the other keys: folding it from registers measured slower there
(44.0 us against 43.2 at the start of the loop; 44.1 at its end, where holding it through the loop
also took the ring kernel from 88 to 138 registers and 51.6 us).

Decode-shaped calls only (every chunk one token, `max_q == 1`): a longer chunk's keys would be read by
several query tiles, and each would store them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.attention._checks import check_dims, check_dtype, check_same_device, check_store, fail
from shared.model.kernels._round import round_to


@dataclass(frozen=True)
class RopeInKernel:
    """What RoPE would do to q and k, and where the rotated k and v go.

    positions [T] int (a token's position; negative ones wrap, as in the RoPE kernel), cos_sin [P, D]
    float (cos half | sin half), optional per-head norm weights [D] with eps, and the store: k_dst /
    v_dst [S, Hkv, D] (a cache viewed flat) at store_index [T] int64 (negative: not stored, and
    not attended either: a graph's padding row). Paged attention's later steps read it through the
    block table, so there store_index must name the token's own row of the pages, as the engine's
    store does.
    """

    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_dst: torch.Tensor
    v_dst: torch.Tensor
    store_index: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0
    # The layer's input before its RMSNorm, [T, H], when q, k and v come from a GEMM of it whose weight
    # holds the norm's weight (`Transformer.fold_norms`): each token's q, k and v are first scaled by
    # rsqrt(mean(x^2) + rms_eps) of its row, and rounded, as the GEMM of norm(x) would have given them.
    rms_x: torch.Tensor | None = None
    rms_eps: float = 0.0

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
    if rope.rms_x is not None:
        x = rope.rms_x
        check_dims(op, "rope.rms_x", x, 2, "[T, H]")
        if x.shape[0] != tokens or x.dtype != q.dtype or x.stride(1) != 1:
            fail(op, f"rope.rms_x must be [T = {tokens}, H] in {q.dtype}, rows contiguous, got "
                     f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
        if not isinstance(rope.rms_eps, float | int) or rope.rms_eps < 0:
            fail(op, f"rope.rms_eps must be a non-negative float, got {rope.rms_eps!r}")
        check_same_device(op, q=q, rms_x=x)
    for name, t in (("rope.k_dst", rope.k_dst), ("rope.v_dst", rope.v_dst)):
        if t.stride(-1) != 1:
            fail(op, f"{name} must have a contiguous last dim")
    weights = {"q_weight": rope.q_weight, "k_weight": rope.k_weight} if rope.norm else {}
    check_same_device(op, q=q, positions=rope.positions, cos_sin=rope.cos_sin, **weights)
    return k_new, v_new


def kernel_args(rope: RopeInKernel | None, q: torch.Tensor, k_new: torch.Tensor) -> tuple:
    """The kernels' RoPE arguments, in order (stand-ins, never read, without `rope`)."""
    if rope is None:
        return (q, q, q, q, q, k_new, k_new, 0, 0, 0, 0, 0, 1, 0.0, q, 0, 1, 0.0)
    qw = rope.q_weight if rope.q_weight is not None else q
    kw = rope.k_weight if rope.k_weight is not None else q
    kd, vd = rope.k_dst, rope.v_dst
    x = rope.rms_x if rope.rms_x is not None else q
    return (
        rope.positions, rope.cos_sin, qw, kw, rope.store_index, kd, vd, rope.cos_sin.stride(0),
        kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1), rope.cos_sin.shape[0], float(rope.eps),
        x, x.stride(0), x.shape[-1] if rope.rms_x is not None else 1, float(rope.rms_eps),
    )  # fmt: skip


def rms_constexprs(rope: RopeInKernel | None) -> dict[str, object]:
    """The kernels' RMS and BLOCK_H: whether q, k and v are scaled by their input row's rsqrt (`rms_x`)."""
    x = rope.rms_x if rope is not None else None
    return {
        "RMS": x is not None,
        "BLOCK_H": max(16, triton.next_power_of_2(x.shape[1])) if x is not None else 16,
    }


@triton.jit
def rotated_rows(
    base, row_ok, tok, pos_ptr, cs_ptr, stride_cs, num_positions, w_ptr, eps, scale,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, RMS: tl.constexpr,
):  # fmt: skip
    """Rows `base[r] + d` ([R] pointers to heads), scaled by `scale` (RMS: the input's norm), normed
    (NORM, weights `w_ptr`) and rotated to positions[tok[r]], as one [R, BLOCK_D] tile in base's dtype
    (columns >= HEAD_DIM are 0).

    A rotation pairs column d with d +- D/2. The partner columns are loaded from memory a second
    time (the first load left the rows in L1), in the tile's own layout: gathering them within the
    tile goes through shared memory, and splitting heads into halves changes the attention loop's
    dot products (both measured slower, docs/benchmarks.md). Each step is the RoPE kernel's
    `_rotate_heads`, rounding included.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = base.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    mask = row_ok[:, None] & d_ok[None, :]
    x = tl.load(base[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if RMS:  # the input's norm, as the GEMM of norm(x) would have rounded its output
        x = round_to(x * scale, dtype)
        xp = round_to(xp * scale, dtype)
    if NORM:
        sq = x * x  # the RoPE kernel sums each half, then adds the two
        lo = tl.sum(tl.where(first[None, :], sq, 0.0), axis=1)
        hi = tl.sum(tl.where(first[None, :], 0.0, sq), axis=1)
        rstd = tl.math.rsqrt((lo + hi) / (2 * HALF) + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = round_to(round_to(x * rstd, dtype) * w, dtype)
        xp = round_to(round_to(xp * rstd, dtype) * wp, dtype)
    # As the RoPE kernel: negative positions wrap (graph padding rows carry -1), the rest is clamped.
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int64)
    pos = tl.where(pos < 0, pos + num_positions, pos)
    pos = tl.minimum(tl.maximum(pos, 0), num_positions - 1)
    cs_row = cs_ptr + pos[:, None] * stride_cs
    j = tl.where(first, d, partner)[None, :]  # d mod D/2: cos_sin holds one half of each
    c = round_to(tl.load(cs_row + j, mask=mask, other=0.0).to(tl.float32), dtype)
    s = round_to(tl.load(cs_row + HALF + j, mask=mask, other=0.0).to(tl.float32), dtype)
    xc = round_to(x * c, dtype)
    ps = round_to(xp * s, dtype)
    # first half: x1 c - x2 s; second half: x2 c + x1 s
    return round_to(tl.where(first[None, :], xc - ps, xc + ps), dtype).to(dtype)


@triton.jit
def store_chunk_keys(
    kn_ptr, vn_ptr, jt, j_ok, kvh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    pos_ptr, cs_ptr, stride_cs, num_positions, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr,
    stride_kds, stride_kdh, stride_vds, stride_vdh, scale,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, RMS: tl.constexpr,
):  # fmt: skip
    """Store the chunk's keys `jt` ([N] token ids, valid where j_ok) of kv head `kvh` at idx[jt] of
    the flat caches, k rotated and v as is (a negative index: not stored). Returns the rotated k and
    the v ([N, BLOCK_D], the caches' dtype) and which rows were stored."""
    k = rotated_rows(
        kn_ptr + jt * stride_knt + kvh * stride_knh, j_ok, jt, pos_ptr, cs_ptr, stride_cs, num_positions,
        kw_ptr, eps, scale, BLOCK_D, HEAD_DIM, NORM, RMS,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    mask = j_ok[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(vn_ptr + (jt * stride_vnt + kvh * stride_vnh)[:, None] + d[None, :], mask=mask, other=0.0)
    if RMS:
        v = round_to(v.to(tl.float32) * scale, kd_ptr.dtype.element_ty).to(v.dtype)
    dst = tl.load(idx_ptr + jt, mask=j_ok, other=-1).to(tl.int64)
    stored = j_ok & (dst >= 0)
    keep = mask & stored[:, None]
    row = tl.maximum(dst, 0)
    tl.store(kd_ptr + (row * stride_kds + kvh * stride_kdh)[:, None] + d[None, :], k, mask=keep)
    tl.store(vd_ptr + (row * stride_vds + kvh * stride_vdh)[:, None] + d[None, :], v, mask=keep)
    return k, v, stored


@triton.jit
def chunk_key(
    has_key, kn_ptr, vn_ptr, tok0, kvh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    pos_ptr, cs_ptr, stride_cs, num_positions, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr,
    stride_kds, stride_kdh, stride_vds, stride_vdh, scale,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, RMS: tl.constexpr,
):  # fmt: skip
    """A decode step's one key (token tok0, kv head kvh; read by this program where `has_key`),
    rotated and stored with its v for the steps after. Returns the rotated key and its v as fp32
    [BLOCK_D] rows, and whether it is attended (`_online_softmax.fold_key` does that, from
    registers): a key with a negative store index (a graph's padding row) is neither stored nor
    attended."""
    # tl.arange's smallest; row 1 is never valid. (A tensor & a scalar bool breaks the interpreter's masks.)
    jr = tl.arange(0, 2)
    k, v, stored = store_chunk_keys(
        kn_ptr, vn_ptr, (tok0 + jr).to(tl.int64), jr < tl.where(has_key, 1, 0), kvh, stride_knt, stride_knh,
        stride_vnt, stride_vnh, pos_ptr, cs_ptr, stride_cs, num_positions, kw_ptr, eps, idx_ptr, kd_ptr,
        vd_ptr, stride_kds, stride_kdh, stride_vds, stride_vdh, scale, BLOCK_D, HEAD_DIM, NORM, RMS,
    )  # fmt: skip
    k_row = tl.sum(tl.where(stored[:, None], k.to(tl.float32), 0.0), axis=0)
    v_row = tl.sum(tl.where(stored[:, None], v.to(tl.float32), 0.0), axis=0)
    return k_row, v_row, tl.sum(stored.to(tl.int32), axis=0) > 0
