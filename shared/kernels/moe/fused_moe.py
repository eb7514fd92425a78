"""Triton mixture-of-experts: `reference.fused_moe`'s experts as two grouped GEMMs and a combine.

1. Align (torch ops on the device): the T*k (token, slot) pairs, numbered p = t*k + j, are sorted by
   expert (a stable sort: within an expert by p), and each expert's run is padded to a multiple of
   BLOCK_M with the sentinel p = T*k. At most min(E, T*k) experts have pairs, so the padded runs fit
   T*k + min(E, T*k) * (BLOCK_M - 1) slots: a size known on the host, so nothing waits for the
   device and the launch fits a CUDA graph. Each BLOCK_M block of slots belongs to one expert
   (`block_expert`, E for the blocks past the last run, whose programs return at once).
2. gate_up (`_gate_up_kernel`, grid (blocks, I / BLOCK_N)): a program gathers its block's token rows
   of x and multiplies them by the expert's gate rows and up rows for the same BLOCK_N columns, so the
   activation is computed in the epilogue and written, rounded to x's dtype, to row p of h [T*k, I].
3. down (`_down_kernel`, grid (blocks, H / BLOCK_N)): h's rows times the expert's w_down; the
   epilogue rounds the expert's output to x's dtype (as its Linear does) and multiplies it by the
   routing weight, and writes row p of parts [T, k, H] float32.
4. combine (`_combine_kernel`, grid (T, H / BLOCK)): out[t] = parts[t, 0] + ... + parts[t, k-1], in that
   order, rounded once: no atomics, the same bits on every run.

The block index is the fastest grid dimension: consecutive programs share an expert's weight tile
while one expert has several blocks (prefill), which L2 then serves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._checks import check_last_dim_contiguous
from shared.kernels._launch import check_triton_device, f32_dot, interpreting, next_pow2
from shared.kernels._round import round_to, rounding_options
from shared.kernels.moe.reference import check_moe
from shared.kernels.silu_mul import glu

__all__ = ["align", "fused_moe"]


@triton.jit
def _swiglu_oai(gate, up, alpha, limit, dtype: tl.constexpr):
    """gpt-oss's activation from float32 gate and up, rounded to `dtype` after each op as torch's are."""
    gate = round_to(tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL), dtype)
    up = round_to(tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL), dtype)
    s = round_to(gate * alpha, dtype)
    s = round_to(1.0 / (1.0 + tl.exp(-s)), dtype)
    return round_to(round_to(up + 1.0, dtype) * round_to(gate * s, dtype), dtype)


@triton.jit
def _dot(a, b_rows, F32_DOT: tl.constexpr):
    """a [M, K] @ b_rows [N, K]^T in float32; exact float32 products for float32 operands, and for
    bfloat16 ones in the interpreter, whose dot cannot take them."""
    if F32_DOT:
        acc = tl.dot(a.to(tl.float32), tl.trans(b_rows.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b_rows))
    return acc


# T*k changes every step: only masks read it, and specializing on it would compile mid-traffic.
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, h_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_experts, hidden, inter,
    stride_x, stride_we, stride_wn, stride_be, stride_h, alpha, limit,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, OAI: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:  # past the last expert's run
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pair < num_pairs  # the sentinel pads the run
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < inter
    x_rows = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_x
    gate_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < hidden
        a = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        acc_gate += _dot(a, tl.load(gate_rows + rk[None, :], mask=w_mask, other=0.0), F32_DOT)
        acc_up += _dot(a, tl.load(up_rows + rk[None, :], mask=w_mask, other=0.0), F32_DOT)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be + rn
        acc_gate += tl.load(b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = round_to(acc_gate, dtype)  # the expert's gate_up Linear rounds its output
    up = round_to(acc_up, dtype)
    h = _swiglu_oai(gate, up, alpha, limit, dtype) if OAI else glu(gate, up, dtype, False)
    out = h_ptr + pair.to(tl.int64)[:, None] * stride_h + rn[None, :]
    tl.store(out, h.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    h_ptr, w_ptr, b_ptr, weights_ptr, parts_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_experts,
    hidden, inter, stride_h, stride_we, stride_wn, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    F32_DOT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pair < num_pairs
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < hidden
    h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < inter
        a = tl.load(h_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _dot(a, tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0), F32_DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = round_to(acc, h_ptr.dtype.element_ty)  # the expert's down Linear rounds its output
    weight = tl.load(weights_ptr + pair, mask=m_ok, other=0.0)
    # Stored, not summed here: the combine only adds loaded values, so no compiler can fuse this
    # product into an add (an FMA would skip its rounding, which the reference has).
    out = parts_ptr + pair.to(tl.int64)[:, None] * hidden + rn[None, :]
    tl.store(out, weight[:, None] * y, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["hidden"])
def _combine_kernel(parts_ptr, out_ptr, hidden, stride_out, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    row = parts_ptr + t * TOP_K * hidden + cols
    acc = tl.load(row, mask=mask, other=0.0)
    for j in tl.static_range(1, TOP_K):  # slot order, whichever expert each slot names
        acc += tl.load(row + j * hidden, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * stride_out + cols, round_to(acc, dtype).to(dtype), mask=mask)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ids [T, k] sorted by expert in runs padded to BLOCK_M (see the module docstring):
    (pairs [blocks * block_m] int32, sentinel T*k in the padding; block_expert [blocks] int32, E for
    the blocks past the last run). Torch ops on the device, sizes from host ints only."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    dev = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + (block_m - 1)) // block_m * block_m
    ends = padded.cumsum(0)
    expert, order = torch.sort(flat, stable=True)  # by expert, then by pair: a deterministic layout
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert]  # place in its expert's run
    blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    pairs = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    pairs.scatter_(0, (ends - padded)[expert] + rank, order.to(torch.int32))
    first_slot = torch.arange(0, blocks * block_m, block_m, device=dev)
    block_expert = torch.searchsorted(ends, first_slot, right=True).to(torch.int32)
    return pairs, block_expert


def _tiles(pairs: int, experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small tiles in the interpreter, whose cost grows with the tile;
    on a GPU 16-row blocks while an expert averages few rows (decode), else 64."""
    if interpreting():
        return 16, 64, 64
    return (16 if pairs <= 4 * experts else 64), 64, 64


def fused_moe(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *, activation: str = "silu", b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
    alpha: float = 1.702, limit: float = 7.0, partial: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `reference.fused_moe`: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I],
    weights [T, k] float32, ids [T, k] int32 (each in [0, E): not checked, an id outside reads out of
    bounds; `partial`: [0, E], E an expert another rank holds: its pairs are sorted into a run of
    their own whose blocks no kernel computes, and their parts stay zero) -> a new [T, H] tensor in
    x's dtype. Biases [E, 2I] and [E, H] in x's dtype. Rows of every
    tensor contiguous along their last dim; no host read (CUDA-graph capturable)."""
    op = "fused_moe"
    m = check_moe(op, x, w_gate_up, w_down, weights, ids, activation, b_gate_up, b_down, alpha, limit)
    check_last_dim_contiguous(op, x=x, w_gate_up=w_gate_up, w_down=w_down)
    for name, b in (("b_gate_up", b_gate_up), ("b_down", b_down)):
        if b is not None:
            check_last_dim_contiguous(op, **{name: b})
    check_triton_device(op, x.device)
    dtype, dev = x.dtype, x.device
    out = torch.empty((m.tokens, m.hidden), dtype=dtype, device=dev)
    if m.tokens == 0 or m.hidden == 0:
        return out
    num_pairs = m.tokens * m.top_k
    block_m, block_n, block_k = _tiles(num_pairs, m.experts)
    pairs, block_expert = align(ids, m.experts + partial, block_m)
    blocks = block_expert.shape[0]
    h = torch.empty((num_pairs, m.inter), dtype=dtype, device=dev)
    new_parts = torch.zeros if partial else torch.empty  # partial: the pairs no kernel writes add 0
    parts = new_parts((m.tokens, m.top_k, m.hidden), dtype=torch.float32, device=dev)
    flat_weights = weights.reshape(-1)  # a copy only if weights is not contiguous
    f32 = f32_dot(dtype)
    launch = {"num_warps": 4, "num_stages": 1 if interpreting() else 3, **rounding_options(dtype)}
    if m.inter > 0:
        bg = b_gate_up if b_gate_up is not None else w_gate_up
        _gate_up_kernel[(blocks, triton.cdiv(m.inter, block_n))](
            x, w_gate_up, bg, h, pairs, block_expert, num_pairs, m.experts, m.hidden, m.inter,
            x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), bg.stride(0), h.stride(0),
            float(alpha), float(limit),
            TOP_K=m.top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            HAS_BIAS=b_gate_up is not None, OAI=activation == "swiglu_oai", F32_DOT=f32, **launch,
        )  # fmt: skip
    bd = b_down if b_down is not None else w_down
    _down_kernel[(blocks, triton.cdiv(m.hidden, block_n))](
        h, w_down, bd, flat_weights, parts, pairs, block_expert, num_pairs, m.experts, m.hidden,
        m.inter, h.stride(0), w_down.stride(0), w_down.stride(1), bd.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=b_down is not None, F32_DOT=f32,
        **launch,
    )  # fmt: skip
    block = min(1024, next_pow2(m.hidden))
    _combine_kernel[(m.tokens, triton.cdiv(m.hidden, block))](
        parts, out, m.hidden, out.stride(0), TOP_K=m.top_k, BLOCK=block, num_warps=4,
        **rounding_options(dtype),
    )  # fmt: skip
    return out
