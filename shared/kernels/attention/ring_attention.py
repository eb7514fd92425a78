"""Triton sliding-window attention for SWA layers: a ring of the last W positions plus the chunk.

The ring still holds the history before the chunk (entry i holds the newest position p < L0 with
p % W == i), and the chunk's own K/V come from k_new/v_new. One program owns one tile of (query,
head) rows of one sequence and one kv head and makes two passes with one online softmax: the ring
entries (at most min(W, L0) of them, oldest first), then the chunk's keys it can see causally.
Everything a program reads is bounded by W + BLOCK_Q keys, whatever the context length. With RoPE
inside (`fused_rope.py`, decode calls) the kernel stores a decode's key into its ring entry first and
the ring holds it too, as its newest entry: pass 1 reads it last, and there is no pass 2.

Decode-shaped calls (see `_launch.choose_splits`) split pass 1 over num_splits programs per query
tile, each taking a run of whole key tiles of the filled entries; pass 2 belongs to the last split,
and `merge_splits` combines the partial results (`_split_k.py`, shared with paged attention).

An FP8 ring (`quant`, KV_FP8) is read as paged attention reads FP8 pages (converted to float16 for
float16 dots, K's scale in the softmax scale, V's on the output); pass 2's chunk keys, read from
k_new/v_new, are quantized and converted back first, so that they are what the ring will hold (as the
reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._checks import check_last_dim_contiguous, check_ring
from shared.kernels._launch import (
    Tiles,
    check_triton_device,
    choose_splits,
    f32_dot,
    fills_gpu,
    quant_args,
    resolve_tiles,
    softmax_scale,
    whole_tiles,
)
from shared.kernels._pdl import pdl_launch, release_next, wait_for_inputs
from shared.kernels._round import rounding_options, to_e4m3
from shared.kernels.attention._online_softmax import (
    attend_block,
    chunk_of,
    fp16_query,
    load_kv_tile,
    softmax_start,
    tile_queries,
)
from shared.kernels.attention._split_k import merge, outputs, split_range, store_result
from shared.kernels.attention.fused_rope import (
    RopeInKernel,
    check_rope_in_kernel,
    kernel_args,
    rms_constexprs,
)
from shared.kernels.attention.reference import check_fp8_out, check_sinks
from shared.kernels.kv_quant import KVQuant


# num_tokens changes every step and num_splits every batch shape: specializing on either (== 1, % 16)
# would compile a new kernel mid-traffic. So would the alignment of the per-sequence int32 fields,
# views into one packed buffer at offsets that move with the batch (read a value at a time, they
# gain nothing from it), nor would the sinks' (a slice of a layer's heads). One compiled kernel per
# query tile.
@triton.jit(
    do_not_specialize=["num_tokens", "num_splits"],
    do_not_specialize_on_alignment=["slots_ptr", "cu_q_ptr", "q_start_ptr", "sinks_ptr"],
)
def _ring_attention_kernel(
    q_ptr, kn_ptr, vn_ptr, kr_ptr, vr_ptr, slots_ptr, cu_q_ptr, q_start_ptr, out_ptr, part_o_ptr,
    part_lse_ptr, stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_krs, stride_kri, stride_krh, stride_vrs, stride_vri, stride_vrh,
    stride_ot, stride_oh, num_tokens, num_q_heads, qk_scale, window, num_splits,
    pos_ptr, cs_ptr, qw_ptr, kw_ptr, idx_ptr, kd_ptr, vd_ptr, stride_cs, stride_kds, stride_kdh, stride_vds,
    stride_vdh, num_positions, eps, rms_ptr, stride_rms, rms_size, rms_eps, v_scale, inv_k, inv_v, sinks_ptr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, F32_DOT: tl.constexpr,
    ROPE: tl.constexpr, NORM: tl.constexpr,
    RMS: tl.constexpr, BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr, SINKS: tl.constexpr,
    PDL: tl.constexpr, WHOLE_TILES: tl.constexpr,
):  # fmt: skip
    release_next(PDL)
    wait_for_inputs(PDL)
    qb = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_off = qb * BLOCK_Q
    tok0, qlen, start = chunk_of(cu_q_ptr, q_start_ptr, b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = q_off < qlen  # a tile past the chunk's end reads nothing and stores nothing
    tl.static_assert(not ROPE or BLOCK_Q == 1)  # decode-shaped calls only (check_rope_in_kernel)
    # Pass 1, the ring: entry i holds the newest position p < held with p % W == i, for i below
    # min(W, held). It is read oldest first: the n entries at logical index t = 0..n-1 hold positions
    # held-n+t, entry (held-n+t) % W. The newest (held-1) is visible to the tile's first query only
    # while q_off < W - 1, so later tiles of a long chunk skip it. With ROPE the decode's own key is
    # stored into its entry (start % W) by the prologue, so the ring holds it too (held = start + 1)
    # and the loop reads it back last, as paged attention reads it from its page; a padding row (a
    # negative store index) stores nothing and the ring holds what it held.
    held = start
    if ROPE:
        stored = tl.load(idx_ptr + tok0.to(tl.int64), mask=live, other=-1) >= 0
        held = start + stored.to(tl.int32)
        # Without its own key (a padding row) the oldest of W entries falls out of the window.
        n = tl.where(live, tl.minimum(window - 1 + stored.to(tl.int32), held), 0)
    else:
        n = tl.where(live & (q_off < window - 1), tl.minimum(window, held), 0)
    oldest = (held - n) % window  # the entry of logical index 0
    # This split's share is [t_lo, t_hi). The key's entry is the last (t = n - 1): the last split
    # stores it, before it reads it.
    t_lo, t_hi = split_range(0, n, split, num_splits, BLOCK_N)
    has_key = live & (split == num_splits - 1)
    kr_base = kr_ptr + slot * stride_krs + kvh * stride_krh
    vr_base = vr_ptr + slot * stride_vrs + kvh * stride_vrh
    q, tok, head, qi, row_ok = tile_queries(
        q_ptr, out_ptr, kn_ptr, vn_ptr, tok0, qlen, kvh, q_off, has_key, stride_qt,
        stride_qh, stride_ot, stride_oh, stride_knt, stride_knh, stride_vnt, stride_vnh, pos_ptr, cs_ptr,
        stride_cs, num_positions, qw_ptr, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr, stride_kds, stride_kdh,
        stride_vds, stride_vdh, rms_ptr, stride_rms, rms_size, rms_eps, inv_k, inv_v, GROUP, GROUP_P2,
        BLOCK_M, BLOCK_D, HEAD_DIM, ROPE, NORM, RMS, BLOCK_H, KV_FP8,
    )  # fmt: skip
    qpos = start + qi
    # As in paged attention: an FP8 ring's tiles convert to float16 (one instruction on sm_90, bf16
    # several; exact), and the dots run in float16.
    F16: tl.constexpr = KV_FP8 and q_ptr.dtype.element_ty != tl.float32
    kv_ty: tl.constexpr = tl.float16 if F16 else q_ptr.dtype.element_ty
    if F16:
        q = fp16_query(q, qk_scale)

    d = tl.arange(0, BLOCK_D)
    d_ok = (d < HEAD_DIM)[None, :]
    # A sink is counted once per row: by split 0, whatever keys it gets (`merge_splits` adds the rest).
    acc, m_i, l_i = softmax_start(sinks_ptr, head, row_ok, split == 0, BLOCK_M, BLOCK_D, SINKS)
    first = held - n  # the position at logical index 0
    # A decode (ROPE) sees every ring entry (at most W of them, the newest its own). WHOLE_TILES (an
    # unsplit decode over an FP8 ring, `_launch.whole_tiles`): its whole tiles go unmasked, only the
    # last, partial one is masked. Other calls mask every tile.
    if WHOLE_TILES:
        tl.static_assert(ROPE)
        t_whole = t_lo + (t_hi - t_lo) // BLOCK_N * BLOCK_N
        for t0 in range(t_lo, t_whole, BLOCK_N):
            acc, m_i, l_i = _ring_tile(
                acc, m_i, l_i, q, kr_base, vr_base, stride_kri, stride_vri, oldest, window, t0, t_hi, first,
                qpos, qk_scale, kv_ty, False, BLOCK_N, BLOCK_D, HEAD_DIM, F32_DOT, F16, KV_FP8,
            )  # fmt: skip
        if t_whole < t_hi:
            acc, m_i, l_i = _ring_tile(
                acc, m_i, l_i, q, kr_base, vr_base, stride_kri, stride_vri, oldest, window, t_whole, t_hi,
                first, qpos, qk_scale, kv_ty, True, BLOCK_N, BLOCK_D, HEAD_DIM, F32_DOT, F16, KV_FP8,
            )  # fmt: skip
    else:
        for t0 in range(t_lo, t_hi, BLOCK_N):
            acc, m_i, l_i = _ring_tile(
                acc, m_i, l_i, q, kr_base, vr_base, stride_kri, stride_vri, oldest, window, t0, t_hi, first,
                qpos, qk_scale, kv_ty, True, BLOCK_N, BLOCK_D, HEAD_DIM, F32_DOT, F16, KV_FP8,
            )  # fmt: skip

    # Pass 2, the chunk: key offsets j with qi - W < j <= qi for some row of the tile. Only the last
    # split reads them (a decode's one key, or a short chunk: not worth a split of their own). With
    # ROPE the chunk is a decode's one key, read in pass 1.
    if not ROPE:
        j_lo = tl.maximum(q_off - window + 1, 0)
        j_hi = tl.where(live & (split == num_splits - 1), tl.minimum(q_off + BLOCK_Q, qlen), j_lo)
        for j0 in range(j_lo, j_hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            j_ok = j < j_hi
            jt = (tok0 + j).to(tl.int64)
            kv_mask = j_ok[:, None] & d_ok
            k_row = jt * stride_knt + kvh * stride_knh
            k = tl.load(kn_ptr + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v_row = jt * stride_vnt + kvh * stride_vnh
            v = tl.load(vn_ptr + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if KV_FP8:  # as the ring will hold them
                k = to_e4m3(k.to(tl.float32), inv_k, kr_ptr.dtype.element_ty).to(kv_ty)
                v = to_e4m3(v.to(tl.float32), inv_v, vr_ptr.dtype.element_ty).to(kv_ty)
            rel = j[None, :] - qi[:, None]
            visible = j_ok[None, :] & (rel <= 0) & (rel > -window)
            acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, F32_DOT, F16)
    if KV_FP8:
        acc = acc * v_scale

    store_result(
        acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, tok, head, row_ok, split, num_tokens, num_q_heads,
        stride_ot, stride_oh, num_splits, BLOCK_D, HEAD_DIM,
    )  # fmt: skip


@triton.jit
def _ring_tile(
    acc, m_i, l_i, q, kr_base, vr_base, stride_kri, stride_vri, oldest, window, t0, t_hi, first, qpos,
    qk_scale, kv_ty: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, F32_DOT: tl.constexpr, F16: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Pass 1's step over the ring entries at logical indices t0 .. t0 + BLOCK_N - 1: those below t_hi
    and in the window when MASKED, all of them otherwise (a decode's whole tiles)."""
    t = t0 + tl.arange(0, BLOCK_N)
    i = oldest + t
    i = tl.where(i >= window, i - window, i)
    d = tl.arange(0, BLOCK_D)
    k_at = kr_base + i[:, None] * stride_kri + d[None, :]
    v_at = vr_base + i[:, None] * stride_vri + d[None, :]
    k, v = load_kv_tile(k_at, v_at, t < t_hi, kv_ty, MASKED, BLOCK_D, HEAD_DIM, KV_FP8)
    # A decode's whole tile (not MASKED): the query is the newest position and sees all n entries.
    visible = (t < t_hi)[None, :] & ((first + t)[None, :] > qpos[:, None] - window) if MASKED else True
    return attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, F32_DOT, F16)


def ring_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
    slots: torch.Tensor, cu_q: torch.Tensor, q_start: torch.Tensor, *, max_q: int, scale: float, window: int,
    num_splits: int | None = None, tiles: Tiles | None = None, rope: RopeInKernel | None = None,
    quant: KVQuant | None = None, sinks: torch.Tensor | None = None, fp8_out: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `reference.ring_attention` (same arguments, same contracts).

    With `rope` (decode-shaped calls), q, k_new arrive before RoPE: the kernel rotates them and stores
    the rotated k and v_new where `rope` says (`fused_rope.py`), instead of a RoPE kernel before it.

    `sinks` (float32 [Hq]; None: none): gpt-oss's attention sinks (`reference.py`), started from by
    split 0's online softmax (`_online_softmax.softmax_start`).

    `num_splits` forces the split-K factor over the ring (any positive int; None picks one from host
    sizes: more than one only for decode-shaped calls on CUDA). `tiles` forces block_n, num_warps,
    num_stages and max_registers (`_launch.resolve_tiles` checks it; None is `choose_tiles`): for
    tuning sweeps.
    """
    op = "ring_attention"
    vl = check_ring(op, q, k_new, v_new, k_ring, v_ring, slots, cu_q, q_start, max_q, scale, window, quant)
    check_sinks(op, sinks, q)
    check_fp8_out(op, fp8_out, quant)
    check_last_dim_contiguous(op, q=q, k_new=k_new, v_new=v_new, k_ring=k_ring, v_ring=v_ring)
    check_triton_device(op, q.device)
    if rope is not None:
        check_rope_in_kernel(op, rope, q, k_new, v_new, max_q, quant)
    full = fills_gpu(q.device, vl.batch * vl.num_kv_heads)
    tiles = resolve_tiles(op, tiles, vl.group, vl.head_dim, max_q, full, kv_fp8=quant is not None)
    # The ring's W entries are what gets split (the chunk's keys all go to the last split).
    num_splits = choose_splits(op, q.device, num_splits, tiles, max_q, vl.batch * vl.num_kv_heads, window)
    out, part_o, part_lse = outputs(q, num_splits, fp8_out)
    grid = (tiles.q_blocks(max_q) * num_splits, vl.batch, vl.num_kv_heads)
    _ring_attention_kernel[grid](
        q, k_new, v_new, k_ring, v_ring, slots, cu_q, q_start, out, part_o, part_lse,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_ring.stride(0), k_ring.stride(1), k_ring.stride(2), v_ring.stride(0), v_ring.stride(1),
        v_ring.stride(2), out.stride(0), out.stride(1), vl.num_tokens, vl.num_q_heads,
        softmax_scale(scale, quant), window, num_splits, *kernel_args(rope, q, k_new),
        *quant_args(quant, fp8_out), q if sinks is None else sinks,  # q: unread without sinks
        GROUP=vl.group, GROUP_P2=tiles.group_p2, BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, HEAD_DIM=vl.head_dim,
        F32_DOT=f32_dot(q.dtype), ROPE=rope is not None, NORM=rope is not None and rope.norm,
        **rms_constexprs(rope), KV_FP8=quant is not None, SINKS=sinks is not None,
        **tiles.launch_options(), **rounding_options(q.dtype),
        **pdl_launch(q.device, vl.num_tokens, max_q == 1),  # decode calls (shared/kernels/_pdl.py)
        WHOLE_TILES=whole_tiles(rope is not None, quant is not None, num_splits),
    )  # fmt: skip
    return merge(out, part_o, part_lse, num_splits)
