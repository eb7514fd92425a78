"""The online-softmax step shared by the paged and the ring attention kernels (a helper, not a kernel).

Rows are (query, head) pairs: the G query heads of one kv head are stacked so that a decode step
(one query) still fills a tensor-core tile and each K/V block is loaded once for the whole group.
Scores live in the log2 domain (qk_scale = scale * log2(e)) so the kernels use exp2.

An attention sink (gpt-oss, SINKS) is one more key per query head, with logit sinks[h] and a zero
value: `softmax_start` folds it in before the first key block (m = the sink, l = 1), so the loop and
`attend_block` stay as they are. With split-K only split 0 starts with it (`_split_k.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.attention.fused_rope import decode_rope

LOG2E = tl.constexpr(1.4426950408889634)  # _launch.LOG2E


@triton.jit
def softmax_start(
    sinks_ptr, head, row_ok, adds_sink, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr
):  # fmt: skip
    """The running (acc, m_i, l_i) before the first key block: empty (m = -inf, l = 0), or with SINKS
    and `adds_sink` holding the rows' sinks as a key already seen: m = sinks[head] in the log2 domain
    (a logit, so not scaled by the softmax scale), l = 2^(m - m) = 1, and nothing in acc (no value).
    A row that then sees no key stores zeros, not NaN. Without SINKS, sinks_ptr is never read."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * LOG2E
        m_i = tl.where(adds_sink, sink, m_i)
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)  # a sink of -inf is no sink
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return acc, m_i, l_i


@triton.jit
def attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, F32_DOT: tl.constexpr, SCALED_Q: tl.constexpr):
    """Fold one key block into the running (acc [M, D], max m_i [M], sum l_i [M]); k, v are [N, D].

    F32_DOT computes both products in exact fp32: for fp32 inputs (tf32 would lose the tight
    agreement fp32 callers expect), and for bf16 under the interpreter, whose bf16 tl.dot is wrong.
    SCALED_Q: q already carries qk_scale (an FP8 cache's float16 dots, `fp16_query`), so the scores
    are not scaled again.
    """
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if not SCALED_Q:
        s = s * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead avoids -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32_DOT:
        # Rounded to v's dtype first, as the tensor-core path does, so both see the same p.
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def load_kv_tile(
    k_at, v_at, rows_ok, kv_ty: tl.constexpr, MASKED: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """One key block's K and V [N, BLOCK_D] at the pointer tiles k_at, v_at: rows past `rows_ok` and
    columns past HEAD_DIM read as zeros when MASKED (or BLOCK_D pads the head), every element loaded
    unmasked otherwise (a decode's whole tile). An FP8 cache's tiles convert to kv_ty, exactly: the
    scales are applied outside the loop."""
    if MASKED or BLOCK_D != HEAD_DIM:
        kv_mask = rows_ok[:, None] & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :]
        k = tl.load(k_at, mask=kv_mask, other=0.0)
        v = tl.load(v_at, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_at)
        v = tl.load(v_at)
    if KV_FP8:
        k = k.to(kv_ty)
        v = v.to(kv_ty)
    return k, v


@triton.jit
def fp16_query(q, qk_scale):
    """The query tile of an FP8 cache's float16 dots, qk_scale folded in (~0.13 at head_dim 128, far
    from float16's 65504) so the scores need no scaling after (attend_block's SCALED_Q)."""
    return (q.to(tl.float32) * qk_scale).to(tl.float16)


@triton.jit
def chunk_of(cu_q_ptr, q_start_ptr, b):
    """Sequence b's chunk: its first token, its length and its start (the tokens before it)."""
    tok0 = tl.load(cu_q_ptr + b)
    qlen = tl.load(cu_q_ptr + b + 1) - tok0
    start = tl.load(q_start_ptr + b)
    return tok0, qlen, start


@triton.jit
def query_rows(
    rows_ptr, tok0, qlen, kvh, q_off, stride_t, stride_h, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Load one tile of (query, head) rows of a chunk (first token tok0, qlen tokens) from `rows_ptr`
    (q, or with RoPE inside attention the output rows `fused_rope.decode_rope` rotated them into);
    returns the tile and each row's token, head, offset in the chunk and validity. BLOCK_M pads the
    rows that can hold data to tl.dot's 16."""
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_M)
    qi = q_off + r // GROUP_P2  # query offset inside the chunk
    g = r % GROUP_P2
    row_ok = (g < GROUP) & (qi < qlen)
    tok = (tok0 + qi).to(tl.int64)
    head = kvh * GROUP + g
    rows = rows_ptr + tok * stride_t + head * stride_h
    q = tl.load(rows[:, None] + d[None, :], mask=row_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    return q, tok, head, qi, row_ok


@triton.jit
def tile_queries(
    q_ptr, out_ptr, kn_ptr, vn_ptr, tok0, qlen, kvh, q_off, has_key, stride_qt, stride_qh, stride_ot,
    stride_oh, stride_knt, stride_knh, stride_vnt, stride_vnh, pos_ptr, cs_ptr, stride_cs, num_positions,
    qw_ptr, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr, stride_kds, stride_kdh, stride_vds, stride_vdh,
    rms_ptr, stride_rms, rms_size, rms_eps, inv_k, inv_v,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr, RMS: tl.constexpr, BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    """A program's query tile (`query_rows`), and with ROPE (decode-shaped calls) its prologue first:
    `fused_rope.decode_rope` rotates the token's query heads into the output rows, where the tile is
    then loaded from, and where `has_key` rotates and stores the token's key (quantized into an FP8
    cache: KV_FP8, inv_k, inv_v). Returns query_rows' values."""
    if ROPE:
        decode_rope(
            q_ptr, out_ptr, kn_ptr, vn_ptr, tok0, kvh, q_off < qlen, has_key, stride_qt, stride_qh,
            stride_ot, stride_oh, stride_knt, stride_knh, stride_vnt, stride_vnh, pos_ptr, cs_ptr, stride_cs,
            num_positions, qw_ptr, kw_ptr, eps, idx_ptr, kd_ptr, vd_ptr, stride_kds, stride_kdh, stride_vds,
            stride_vdh, rms_ptr, stride_rms, rms_size, rms_eps, inv_k, inv_v, GROUP, GROUP_P2, BLOCK_D,
            HEAD_DIM, NORM, RMS, BLOCK_H, KV_FP8,
        )  # fmt: skip
        rows_ptr, stride_t, stride_h = out_ptr, stride_ot, stride_oh
    else:
        rows_ptr, stride_t, stride_h = q_ptr, stride_qt, stride_qh
    return query_rows(
        rows_ptr, tok0, qlen, kvh, q_off, stride_t, stride_h, GROUP, GROUP_P2, BLOCK_M, BLOCK_D, HEAD_DIM
    )  # fmt: skip
