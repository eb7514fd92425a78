"""Triton paged attention over a varlen batch: prefill chunks, decode, and sliding windows.

One program owns one tile of (query, head) rows of one sequence and one kv head, and walks the keys
it can see in blocks of BLOCK_N positions, gathering each key's page through the block table (so
any page size works and a block may straddle pages). With NUM_SPLITS > 1 (decode with few
programs, see `_launch.choose_splits`) each program takes one slice of the key range and writes a
partial result that `merge_splits` combines.

All loop bounds are read on the device from cu_q / q_start, so the launch depends on host sizes
only and the whole call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.attention._checks import check_last_dim_contiguous, check_paged
from shared.attention._launch import LOG2E, check_triton_device, choose_splits, choose_tiles, f32_dot
from shared.attention._online_softmax import attend_block, query_rows
from shared.attention.merge_splits import merge_splits


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, q_start_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh, num_tokens, num_q_heads, qk_scale, window,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    qb = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_off = qb * BLOCK_Q
    q, tok, head, qi, row_ok, _tok0, qlen, start = query_rows(
        q_ptr, cu_q_ptr, q_start_ptr, b, kvh, q_off, stride_qt, stride_qh,
        GROUP, GROUP_P2, BLOCK_M, BLOCK_D, HEAD_DIM,
    )  # fmt: skip
    qpos = start + qi
    # Keys this tile can see: [lo, hi). A tile past the chunk's end (max_q covers the longest chunk)
    # gets an empty range and stores nothing.
    hi = start + tl.minimum(q_off + BLOCK_Q, qlen)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(start + q_off - window + 1, 0)
    hi = tl.where(q_off < qlen, hi, lo)
    per_split = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_lo = lo + split * per_split
    k_hi = tl.minimum(hi, k_lo + per_split)

    d = tl.arange(0, BLOCK_D)
    d_ok = (d < HEAD_DIM)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(k_lo, k_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < k_hi
        page = tl.load(bt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % PAGE_SIZE
        kv_mask = n_ok[:, None] & d_ok
        k_row = page * stride_kp + slot * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v_row = page * stride_vp + slot * stride_vs + kvh * stride_vh
        v = tl.load(v_ptr + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        visible = n_ok[None, :] & (n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, F32_DOT)

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & d_ok
    if NUM_SPLITS == 1:
        out = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials are [NUM_SPLITS, T, Hq, (D)] fp32; an empty split has lse = -inf and weighs nothing.
        row = (split * num_tokens + tok) * num_q_heads + head
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cu_q: torch.Tensor, q_start: torch.Tensor, *, max_q: int, scale: float, window: int | None,
    num_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `reference.paged_attention` (same arguments, same contracts).

    `num_splits` overrides the split-K factor (a power of two is best; None picks one from host sizes).
    """
    op = "paged_attention"
    vl = check_paged(op, q, k_cache, v_cache, block_table, cu_q, q_start, max_q, scale, window)
    check_last_dim_contiguous(op, q=q, k_cache=k_cache, v_cache=v_cache)
    if block_table.stride(1) != 1:
        raise ValueError(f"{op}: block_table rows must be contiguous, got strides {block_table.stride()}")
    check_triton_device(op, q.device)
    page_size = k_cache.shape[1]
    tiles = choose_tiles(vl.group, vl.head_dim, max_q)
    q_blocks = tiles.q_blocks(max_q)
    if num_splits is None:
        span = block_table.shape[1] * page_size  # the most keys one program can read
        if window is not None:
            span = min(span, window + tiles.block_q - 1)
        num_splits = choose_splits(q.device, q_blocks * vl.batch * vl.num_kv_heads, span, max_q)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{op}: num_splits must be a positive int, got {num_splits!r}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_splits > 1:
        part_o = torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, *q.shape[:2], dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel
    grid = (q_blocks * num_splits, vl.batch, vl.num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_table, cu_q, q_start, out, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), vl.num_tokens, vl.num_q_heads, float(scale) * LOG2E,
        window if window is not None else 0,
        GROUP=vl.group, GROUP_P2=tiles.group_p2, BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, HEAD_DIM=vl.head_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, F32_DOT=f32_dot(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(part_o, part_lse, out)
    return out
