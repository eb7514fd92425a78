"""RoPE (and Qwen3's per-head q/k norm) applied by a decode attention kernel, with the K/V store.

In a decode step a layer's RoPE kernel does little work for one graph node of its own: rotate one
token's heads and write its K/V into the cache. The attention kernels can do that work themselves:
each program already loads its query rows, and the program that reads the chunk's key (the last
split of a (sequence, kv head)) rotates it, stores it and its v, then reads it back with the other
keys. One node fewer per layer. The rotated values match the RoPE kernel (`shared/kernels/rope.py`):
the same roundings in the same order.

The attention loop stays the plain kernel's. Only the rows that hold data are rotated, as a small tile
of their own (a decode tile of 16 rows holds 2 query rows and 1 key): rotating the whole padded tile
needs more registers a program, so fewer programs fit on an SM and the 512 programs of a batch-64
step would not all run in one wave. The rotated query rows go to the program's own output rows and,
after a barrier, the kernel loads them back as the plain kernel loads its tile. Each column's
rotation partner is loaded from memory a second time, in the tile's own layout (`decode_rope`).

The token's key is rotated and stored (its v too) before the loop, and the loop reads it back with
the other keys: paged attention from its page, ring attention from its ring entry as its newest key
(the ring, read oldest first, then holds the token's position too). So the store index must name
that row: the token's own row of the pages, or its ring entry (slot * W + position % W), as the
engine's stores do. Folding the key into the online softmax from registers before the ring would
save little and cost the prologue much: its reductions and layout changes would be about a third of
the prologue's instructions and most of its barriers, where the loop reads the key at no cost beside
the others.

All of it is one prologue (`decode_rope`) that issues every load needing only the token at once, then
the position's cos/sin, then the math and the stores, under one barrier, so that the input's norm,
the query rows and the key do not each wait for the loads before them: the prologue's length is the
fixed cost of a call.

Decode-shaped calls only (every chunk one token, `max_q == 1`): a longer chunk's keys would be read by
several query tiles, and each would store them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.kernels._checks import check_dims, check_dtype, check_same_device, check_store, fail
from shared.kernels._round import round_to, to_e4m3
from shared.kernels._rows import load_row, rstd_of
from shared.kernels.kv_quant import KVQuant


@dataclass(frozen=True)
class RopeInKernel:
    """What RoPE would do to q and k, and where the rotated k and v go.

    positions [T] int (a token's position; negative ones wrap, as in the RoPE kernel), cos_sin [P, D]
    float (cos half | sin half), optional per-head norm weights [D] with eps, and the store: k_dst /
    v_dst [S, Hkv, D] (a cache viewed flat) at store_index [T] int64 (negative: not stored, and
    not attended either: a graph's padding row). The kernels read the key back from where it was
    stored, so store_index must name the token's own row: of the pages (paged attention's later steps
    read it through the block table), or of the ring, slot * W + position % W; as the engine's stores
    do.
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
    quant: KVQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every argument check of RoPE inside attention; returns the chunk's (k_new, v_new). `quant`: the
    store goes into an FP8 cache with these scales."""
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
    check_store(op, k_new, v_new, rope.k_dst, rope.v_dst, rope.store_index, quant)
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
def rotate(
    x, xp, c, s, w, wp, eps, scale, first, dtype: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    RMS: tl.constexpr,
):  # fmt: skip
    """Rows x (fp32 [R, BLOCK_D], columns >= HEAD_DIM 0) rotated by RoPE, in `dtype`: xp holds each
    column's rotation partner (column d +- D/2), c and s the cos and sin of the rows' positions laid
    out as x, w and wp the per-head norm weight at x's and xp's columns (NORM). Each step is the RoPE
    kernel's `_rotate_heads`, rounding included; RMS first scales by `scale` (the input's norm), as
    the GEMM of norm(x) would have rounded its output."""
    if RMS:
        x = round_to(x * scale, dtype)
        xp = round_to(xp * scale, dtype)
    if NORM:
        sq = x * x  # the RoPE kernel sums each half, then adds the two
        lo = tl.sum(tl.where(first[None, :], sq, 0.0), axis=1)
        hi = tl.sum(tl.where(first[None, :], 0.0, sq), axis=1)
        rstd = tl.math.rsqrt((lo + hi) / (2 * HALF) + eps)[:, None]
        x = round_to(round_to(x * rstd, dtype) * w, dtype)
        xp = round_to(round_to(xp * rstd, dtype) * wp, dtype)
    xc = round_to(x * round_to(c, dtype), dtype)
    ps = round_to(xp * round_to(s, dtype), dtype)
    # first half: x1 c - x2 s; second half: x2 c + x1 s
    return round_to(tl.where(first[None, :], xc - ps, xc + ps), dtype).to(dtype)


@triton.jit
def decode_rope(
    q_ptr, out_ptr, kn_ptr, vn_ptr, tok0, kvh, has_tok, has_key, stride_qt, stride_qh, stride_ot,
    stride_oh, stride_knt, stride_knh, stride_vnt, stride_vnh, pos_ptr, cs_ptr, stride_cs, num_positions,
    qw_ptr, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr, stride_kds, stride_kdh, stride_vds, stride_vdh,
    rms_ptr, stride_rms, rms_size, rms_eps, inv_k, inv_v,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr, RMS: tl.constexpr, BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """A decode program's prologue: token tok0's GROUP query heads of kv head `kvh` rotated into this
    program's output rows (where `has_tok`: the program has a token), and, where `has_key` (the
    program that owns the token's key), its key rotated and stored with its v at store_index[tok0]
    (a negative index: neither stored nor attended); into an FP8 cache (KV_FP8) quantized with inv_k
    and inv_v, as any store into it is. Ends with a barrier: every thread's stores land before any
    thread reads the query rows or the key back.

    Every load that needs only the token is issued first, the position's cos/sin next, then the math:
    a program's prologue is a chain of dependent loads that no K/V traffic hides (in a batch-64
    decode all programs start together, in one wave), so its length is the kernel's fixed cost. Each
    column's rotation partner is loaded a second time, in the rows' own layout: gathering it within
    the tile goes through shared memory, and splitting heads into halves changes the attention loop's
    dot products (both slower).
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    tok = tok0.to(tl.int64)
    # 1. The token's query heads, key, value, store index and position, and the input row of RMS.
    g = tl.arange(0, GROUP_P2)
    q_ok = g < tl.where(has_tok, GROUP, 0)  # (a tensor & a scalar bool breaks the interpreter's masks)
    q_mask = q_ok[:, None] & d_ok[None, :]
    q_rows = q_ptr + tok * stride_qt + (kvh * GROUP + g) * stride_qh
    xq = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    xqp = tl.load(q_rows[:, None] + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    jr = tl.arange(0, 2)  # tl.arange's smallest; row 1 is never valid
    k_ok = jr < tl.where(has_key, 1, 0)
    k_mask = k_ok[:, None] & d_ok[None, :]
    k_rows = kn_ptr + (tok + jr) * stride_knt + kvh * stride_knh
    xk = tl.load(k_rows[:, None] + d[None, :], mask=k_mask, other=0.0).to(tl.float32)
    xkp = tl.load(k_rows[:, None] + partner[None, :], mask=k_mask, other=0.0).to(tl.float32)
    v_rows = vn_ptr + (tok + jr) * stride_vnt + kvh * stride_vnh
    v = tl.load(v_rows[:, None] + d[None, :], mask=k_mask, other=0.0)
    dst = tl.load(idx_ptr + tok + jr, mask=k_ok, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=has_tok, other=0).to(tl.int64)
    # What every row shares (cos/sin, the norm weights) is loaded once per row, in the rows' own
    # shape: loaded once, a [D] or [1, D] row gets a layout of its own, and moving it into the rows'
    # took a trip through shared memory behind a barrier for each of them.
    zq = tl.zeros([GROUP_P2, 1], tl.int32)
    zk = tl.zeros([2, 1], tl.int32)
    cols = d_ok[None, :]
    qw, qwp, kw, kwp = 1.0, 1.0, 1.0, 1.0
    if NORM:
        qw = tl.load(qw_ptr + zq + d[None, :], mask=cols, other=0.0).to(tl.float32)
        qwp = tl.load(qw_ptr + zq + partner[None, :], mask=cols, other=0.0).to(tl.float32)
        kw = tl.load(kw_ptr + zk + d[None, :], mask=cols, other=0.0).to(tl.float32)
        kwp = tl.load(kw_ptr + zk + partner[None, :], mask=cols, other=0.0).to(tl.float32)
    if RMS:
        x_row = load_row(rms_ptr, tok, stride_rms, rms_size, BLOCK_H)
    # 2. Its position's cos and sin. As the RoPE kernel: a negative position wraps (graph padding rows
    # carry -1), the rest is clamped.
    pos = tl.where(pos < 0, pos + num_positions, pos)
    pos = tl.minimum(tl.maximum(pos, 0), num_positions - 1)
    j = tl.where(first, d, partner)[None, :]  # d mod D/2: cos_sin holds one half of each
    cs_row = cs_ptr + pos * stride_cs
    cq = tl.load(cs_row + zq + j, mask=cols, other=0.0).to(tl.float32)
    sq = tl.load(cs_row + HALF + zq + j, mask=cols, other=0.0).to(tl.float32)
    ck = tl.load(cs_row + zk + j, mask=cols, other=0.0).to(tl.float32)
    sk = tl.load(cs_row + HALF + zk + j, mask=cols, other=0.0).to(tl.float32)
    # 3. The math, and the stores.
    scale = 1.0
    if RMS:  # a decode's chunk is one token: one scale for its query heads, key and value
        scale = rstd_of(x_row, rms_size, rms_eps)
    q_rot = rotate(xq, xqp, cq, sq, qw, qwp, eps, scale, first, q_ptr.dtype.element_ty, HALF, NORM, RMS)
    out = out_ptr + (tok * stride_ot + (kvh * GROUP + g) * stride_oh)[:, None] + d[None, :]
    tl.store(out, q_rot, mask=q_mask)
    k = rotate(xk, xkp, ck, sk, kw, kwp, eps, scale, first, kn_ptr.dtype.element_ty, HALF, NORM, RMS)
    if RMS:
        v = round_to(v.to(tl.float32) * scale, vn_ptr.dtype.element_ty).to(v.dtype)
    if KV_FP8:
        k = to_e4m3(k.to(tl.float32), inv_k, kd_ptr.dtype.element_ty)
        v = to_e4m3(v.to(tl.float32), inv_v, vd_ptr.dtype.element_ty)
    stored = k_ok & (dst >= 0)
    keep = k_mask & stored[:, None]
    row = tl.maximum(dst, 0)
    tl.store(kd_ptr + (row * stride_kds + kvh * stride_kdh)[:, None] + d[None, :], k, mask=keep)
    tl.store(vd_ptr + (row * stride_vds + kvh * stride_vdh)[:, None] + d[None, :], v, mask=keep)
    tl.debug_barrier()  # every thread's rows are stored before any thread loads them back
