"""The online-softmax step shared by the paged and the ring attention kernels (a helper, not a kernel).

Rows are (query, head) pairs: the G query heads of one kv head are stacked so that a decode step
(one query) still fills a tensor-core tile and each K/V block is loaded once for the whole group.
Scores live in the log2 domain (qk_scale = scale * log2(e)) so the kernels use exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.attention.fused_rope import rotated_rows
from shared.model.kernels._rows import row_rstd


@triton.jit
def attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, F32_DOT: tl.constexpr):
    """Fold one key block into the running (acc [M, D], max m_i [M], sum l_i [M]); k, v are [N, D].

    F32_DOT computes both products in exact fp32: for fp32 inputs (tf32 would lose the tight
    agreement fp32 callers expect), and for bf16 under the interpreter, whose bf16 tl.dot is wrong.
    """
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * qk_scale, float("-inf"))
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
def fold_key(acc, m_i, l_i, q, k_row, v_row, seen, qk_scale):
    """Fold one key held in registers (k_row, v_row: fp32 [D]; attended where `seen`) into the running
    softmax, as `attend_block` would fold a block holding only it: its p rounded to q's dtype first."""
    s = tl.sum(q.to(tl.float32) * k_row[None, :], axis=1) * qk_scale
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe).to(q.dtype).to(tl.float32)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_row[None, :]
    return acc, m_new, l_i


@triton.jit
def query_rows(
    q_ptr, cu_q_ptr, q_start_ptr, out_ptr, b, kvh, q_off, stride_qt, stride_qh, stride_ot, stride_oh,
    pos_ptr, cs_ptr, stride_cs, num_positions, qw_ptr, eps, rms_ptr, stride_rms, rms_size, rms_eps,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
    RMS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Load one tile of (query, head) rows; returns the tile and each row's token, head, offset,
    validity, and the chunk's row scale (RMS: rsqrt(mean(x^2) + eps) of its first token's input row,
    `fused_rope.RopeInKernel.rms_x`; 1 without it).

    With ROPE the rows arrive before RoPE: the BLOCK_Q x GROUP_P2 rows that can hold data (BLOCK_M
    pads them to tl.dot's 16) are normed (NORM) and rotated as a tile of their own into the output
    rows this program owns (its result overwrites them), then loaded from there (`fused_rope.py`).
    """
    tok0 = tl.load(cu_q_ptr + b)
    qlen = tl.load(cu_q_ptr + b + 1) - tok0
    start = tl.load(q_start_ptr + b)
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < HEAD_DIM)[None, :]
    scale = 1.0
    if RMS:  # a decode's chunk is one token: one scale for the program's rows and key
        scale = row_rstd(rms_ptr, tok0, stride_rms, rms_size, rms_eps, BLOCK_H)
    if ROPE:
        rr = tl.arange(0, BLOCK_Q * GROUP_P2)
        qi_r = q_off + rr // GROUP_P2
        g_r = rr % GROUP_P2
        ok_r = (g_r < GROUP) & (qi_r < qlen)
        tok_r = (tok0 + qi_r).to(tl.int64)
        head_r = kvh * GROUP + g_r
        rotated = rotated_rows(
            q_ptr + tok_r * stride_qt + head_r * stride_qh, ok_r, tok_r, pos_ptr, cs_ptr, stride_cs,
            num_positions, qw_ptr, eps, scale, BLOCK_D, HEAD_DIM, NORM, RMS,
        )  # fmt: skip
        dst = out_ptr + (tok_r * stride_ot + head_r * stride_oh)[:, None] + d[None, :]
        tl.store(dst, rotated, mask=ok_r[:, None] & d_ok)
        tl.debug_barrier()  # every thread's rows are stored before any thread loads the tile
    r = tl.arange(0, BLOCK_M)
    qi = q_off + r // GROUP_P2  # query offset inside the chunk
    g = r % GROUP_P2
    row_ok = (g < GROUP) & (qi < qlen)
    tok = (tok0 + qi).to(tl.int64)
    head = kvh * GROUP + g
    if ROPE:
        rows = out_ptr + tok * stride_ot + head * stride_oh
    else:
        rows = q_ptr + tok * stride_qt + head * stride_qh
    q = tl.load(rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok, other=0.0)
    return q, tok, head, qi, row_ok, tok0, qlen, start, scale
