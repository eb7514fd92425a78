"""Triton paged attention over a varlen batch: prefill chunks, decode, and sliding windows.

One program owns one tile of (query, head) rows of one sequence and one kv head, and walks the keys
it can see in blocks of BLOCK_N positions, gathering each key's page through the block table (so
any page size works and a block may straddle pages). With num_splits > 1 (decode-shaped calls
with few programs, see `_launch.choose_splits`) each program takes one slice of the key range and
writes a partial result that `merge_splits` combines (`_split_k.py`).

All loop bounds are read on the device from cu_q / q_start, so the launch depends on host sizes
only and the whole call can be captured in a CUDA graph.

An FP8 cache (`quant`, KV_FP8) is read a tile at a time and converted to float16 (exact: every e4m3
value is one; a bf16 q's dtype would cost several instructions a pair on sm_90, float16 one), and a
bf16 or float16 q's loop runs its dots in float16, the query tile scaled by qk_scale once before it
(`fp16_query`), p rounded to float16, accumulating in fp32 (an fp32 q's reads convert to fp32). K's
per-tensor scale is folded into the softmax scale and V's multiplies the output once, after the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._checks import check_last_dim_contiguous, check_paged
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
from shared.kernels._round import rounding_options
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


# num_tokens and the block table's width change every step, num_splits every batch shape: specializing
# on them (== 1, % 16) would compile a new kernel mid-traffic. So would the alignment of the block
# table and the per-sequence int32 fields, views into one packed buffer at offsets that move with the
# batch (read a few values at a time), or of the sinks (a slice of a layer's heads, read once). One
# compiled kernel per query tile.
@triton.jit(
    do_not_specialize=["stride_bt", "num_tokens", "num_splits"],
    do_not_specialize_on_alignment=["bt_ptr", "cu_q_ptr", "q_start_ptr", "sinks_ptr"],
)
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, q_start_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh, num_tokens, num_q_heads, qk_scale, window, num_splits,
    kn_ptr, vn_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh,
    pos_ptr, cs_ptr, qw_ptr, kw_ptr, idx_ptr, kd_ptr, vd_ptr, stride_cs, stride_kds, stride_kdh, stride_vds,
    stride_vdh, num_positions, eps, rms_ptr, stride_rms, rms_size, rms_eps, v_scale, inv_k, inv_v, sinks_ptr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, F32_DOT: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
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
    live = q_off < qlen
    tl.static_assert(not ROPE or BLOCK_Q == 1)  # decode-shaped calls only (check_rope_in_kernel)
    # With ROPE the chunk's key (a decode's one: max_q == 1) is not in the pages yet: the last split,
    # whose keys end with it, rotates and stores it there first; the loop reads it back after the
    # prologue's barrier, as any other key.
    q, tok, head, qi, row_ok = tile_queries(
        q_ptr, out_ptr, kn_ptr, vn_ptr, tok0, qlen, kvh, q_off, live & (split == num_splits - 1), stride_qt,
        stride_qh, stride_ot, stride_oh, stride_knt, stride_knh, stride_vnt, stride_vnh, pos_ptr, cs_ptr,
        stride_cs, num_positions, qw_ptr, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr, stride_kds, stride_kdh,
        stride_vds, stride_vdh, rms_ptr, stride_rms, rms_size, rms_eps, inv_k, inv_v, GROUP, GROUP_P2,
        BLOCK_M, BLOCK_D, HEAD_DIM, ROPE, NORM, RMS, BLOCK_H, KV_FP8,
    )  # fmt: skip
    qpos = start + qi
    # An FP8 cache's tiles convert to float16, not to a bf16 q's dtype: e4m3 -> f16 is one instruction
    # on sm_90 (-> bf16 several), and float16 holds every e4m3 value exactly. The dots run in float16.
    F16: tl.constexpr = KV_FP8 and q_ptr.dtype.element_ty != tl.float32
    kv_ty: tl.constexpr = tl.float16 if F16 else q_ptr.dtype.element_ty
    if F16:
        q = fp16_query(q, qk_scale)
    # Keys this tile can see: [lo, hi). A tile past the chunk's end (max_q covers the longest chunk)
    # gets an empty range and stores nothing.
    hi = start + tl.minimum(q_off + BLOCK_Q, qlen)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(start + q_off - window + 1, 0)
    hi = tl.where(live, hi, lo)
    k_lo, k_hi = split_range(lo, hi, split, num_splits, BLOCK_N)

    # A sink is counted once per row: by split 0, whatever keys it gets (`merge_splits` adds the rest).
    acc, m_i, l_i = softmax_start(sinks_ptr, head, row_ok, split == 0, BLOCK_M, BLOCK_D, SINKS)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # A decode (ROPE) query is the newest position, and its range holds only keys it sees. WHOLE_TILES
    # (an unsplit decode over FP8 pages, `_launch.whole_tiles`): its whole tiles go unmasked, only the
    # last, partial one is masked. Other calls mask every tile.
    if WHOLE_TILES:
        tl.static_assert(ROPE)
        k_whole = k_lo + (k_hi - k_lo) // BLOCK_N * BLOCK_N
        for n0 in range(k_lo, k_whole, BLOCK_N):
            acc, m_i, l_i = _paged_tile(
                acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kvh, n0, k_hi, qpos, window, qk_scale, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, kv_ty, False, BLOCK_N, BLOCK_D,
                HEAD_DIM, PAGE_SIZE, F32_DOT, F16, KV_FP8, HAS_WINDOW,
            )  # fmt: skip
        if k_whole < k_hi:
            acc, m_i, l_i = _paged_tile(
                acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kvh, k_whole, k_hi, qpos, window, qk_scale, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, kv_ty, True, BLOCK_N, BLOCK_D,
                HEAD_DIM, PAGE_SIZE, F32_DOT, F16, KV_FP8, HAS_WINDOW,
            )  # fmt: skip
    else:
        for n0 in range(k_lo, k_hi, BLOCK_N):
            acc, m_i, l_i = _paged_tile(
                acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kvh, n0, k_hi, qpos, window, qk_scale, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, kv_ty, True, BLOCK_N, BLOCK_D,
                HEAD_DIM, PAGE_SIZE, F32_DOT, F16, KV_FP8, HAS_WINDOW,
            )  # fmt: skip
    if KV_FP8:
        acc = acc * v_scale

    store_result(
        acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, tok, head, row_ok, split, num_tokens, num_q_heads,
        stride_ot, stride_oh, num_splits, BLOCK_D, HEAD_DIM,
    )  # fmt: skip


@triton.jit
def _paged_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kvh, n0, k_hi, qpos, window, qk_scale, stride_kp, stride_ks,
    stride_kh, stride_vp, stride_vs, stride_vh, kv_ty: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    F32_DOT: tl.constexpr, F16: tl.constexpr, KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """The step over keys n0 .. n0 + BLOCK_N - 1, read through the block table: those below k_hi and
    visible to each row (causal, in the window) when MASKED, all of them otherwise (a decode's whole
    tiles)."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    n_ok = n < k_hi
    if MASKED:
        page = tl.load(bt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + n // PAGE_SIZE).to(tl.int64)
    slot = n % PAGE_SIZE
    k_at = k_ptr + (page * stride_kp + slot * stride_ks + kvh * stride_kh)[:, None] + d[None, :]
    v_at = v_ptr + (page * stride_vp + slot * stride_vs + kvh * stride_vh)[:, None] + d[None, :]
    k, v = load_kv_tile(k_at, v_at, n_ok, kv_ty, MASKED, BLOCK_D, HEAD_DIM, KV_FP8)
    if MASKED:
        visible = n_ok[None, :] & (n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
    else:
        visible = True
    return attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, F32_DOT, F16)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cu_q: torch.Tensor, q_start: torch.Tensor, *, max_q: int, scale: float, window: int | None,
    num_splits: int | None = None, tiles: Tiles | None = None, k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None, rope: RopeInKernel | None = None, quant: KVQuant | None = None,
    sinks: torch.Tensor | None = None, fp8_out: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `reference.paged_attention` (same arguments, same contracts).

    With `rope` (decode-shaped calls), the pages do not hold the chunk yet: q and k_new [T, Hkv, D]
    arrive before RoPE, and the kernel rotates them, stores the rotated k and v_new where `rope` says
    (the pages, viewed flat) and attends to them (`fused_rope.py`), instead of a RoPE kernel before it.

    `sinks` (float32 [Hq]; None: none): gpt-oss's attention sinks (`reference.py`), started from by
    split 0's online softmax (`_online_softmax.softmax_start`).

    `num_splits` forces the split-K factor (any positive int; None picks one from host sizes). `tiles`
    forces block_n, num_warps, num_stages and max_registers (`_launch.resolve_tiles` checks it; None is
    `choose_tiles`): for tuning sweeps.
    """
    op = "paged_attention"
    vl = check_paged(op, q, k_cache, v_cache, block_table, cu_q, q_start, max_q, scale, window, quant)
    check_sinks(op, sinks, q)
    check_fp8_out(op, fp8_out, quant)
    check_last_dim_contiguous(op, q=q, k_cache=k_cache, v_cache=v_cache)
    if block_table.stride(1) != 1:
        raise ValueError(f"{op}: block_table rows must be contiguous, got strides {block_table.stride()}")
    check_triton_device(op, q.device)
    kn, vn = k_cache[0], v_cache[0]  # unread without rope
    if rope is not None:
        kn, vn = check_rope_in_kernel(op, rope, q, k_new, v_new, max_q, quant)
        check_last_dim_contiguous(op, k_new=kn, v_new=vn)
    page_size = k_cache.shape[1]
    full = fills_gpu(q.device, vl.batch * vl.num_kv_heads)
    tiles = resolve_tiles(op, tiles, vl.group, vl.head_dim, max_q, full, kv_fp8=quant is not None)
    span = block_table.shape[1] * page_size  # the most keys one program can read
    if window is not None:
        span = min(span, window + tiles.block_q - 1)
    num_splits = choose_splits(op, q.device, num_splits, tiles, max_q, vl.batch * vl.num_kv_heads, span)
    out, part_o, part_lse = outputs(q, num_splits, fp8_out)
    grid = (tiles.q_blocks(max_q) * num_splits, vl.batch, vl.num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_table, cu_q, q_start, out, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), vl.num_tokens, vl.num_q_heads, softmax_scale(scale, quant),
        window if window is not None else 0, num_splits,
        kn, vn, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), *kernel_args(rope, q, kn),
        *quant_args(quant, fp8_out), q if sinks is None else sinks,  # q: unread without sinks
        GROUP=vl.group, GROUP_P2=tiles.group_p2, BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, HEAD_DIM=vl.head_dim, PAGE_SIZE=page_size,
        HAS_WINDOW=window is not None, F32_DOT=f32_dot(q.dtype), ROPE=rope is not None,
        NORM=rope is not None and rope.norm, **rms_constexprs(rope), KV_FP8=quant is not None,
        SINKS=sinks is not None, **tiles.launch_options(),
        **rounding_options(q.dtype),
        **pdl_launch(q.device, vl.num_tokens, max_q == 1),  # decode calls (shared/kernels/_pdl.py)
        WHOLE_TILES=whole_tiles(rope is not None, quant is not None, num_splits),
    )  # fmt: skip
    return merge(out, part_o, part_lse, num_splits)
