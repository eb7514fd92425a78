"""Triton FP8 GEMM with scales: out[M, N] = dequant(a)[M, K] @ dequant(w)[N, K]^T on the tensor cores'
e4m3 path, accumulated in float32, with the bias and a residual add in the epilogue.

The path where cuBLAS has none (`scaled_mm.py` says which): weights whose scales are per row and
128-column group (a fused projection whose parts do not start on a 128-row boundary), shapes cuBLAS's
scaled GEMMs refuse (K or N not a multiple of 16; block scales with K not a multiple of 512), GPUs
without cuBLAS's block scaling; and the CPU tests (interpreted).

Two scalings. Per row (per-channel weights, per-token activations, one K group): the products are
summed unscaled and each output scaled once, by its row's and column's scales. Per K group (block
weights, activations in 128-column groups): a K step is one group, and its partial product is scaled
by that group's activation scales (a column of the tile's rows) and weight scales (a row of the tile's
columns) before it joins the sum, as DeepSeek's recipe has it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._norm_checks import check_dims, check_same_device, check_triton_device, fail
from shared.kernels._round import round_to
from shared.kernels.fp8.reference import E4M3, Fp8Act

__all__ = ["gemm"]


# M changes every step: only masks and the scales' stride read it (BLOCK_M takes four values).
@triton.jit(do_not_specialize=["M", "stride_asg"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsg, stride_om,
    W_ROWS: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    as_rows = as_ptr + rm * stride_asm
    ws_cols = ws_ptr + (rn // W_ROWS) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(a_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        part = tl.dot(a, w)
        if GROUPED:  # a K step is one scale group
            sa = tl.load(as_rows + kb * stride_asg, mask=m_ok, other=0.0)
            sw = tl.load(ws_cols + kb * stride_wsg, mask=n_ok, other=0.0)
            acc += part * sa[:, None] * sw[None, :]
        else:
            acc += part
    if not GROUPED:
        sa = tl.load(as_rows, mask=m_ok, other=0.0)
        sw = tl.load(ws_cols, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sw[None, :]
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ADD:  # out holds the residual: the sum is rounded once
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, round_to(acc, dtype).to(dtype), mask=mask)


def _check(op: str, a: Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """Shapes, dtypes and layouts (never values); whether the scales are per K group."""
    check_dims(op, "a.data", a.data, 2, "[M, K]")
    check_dims(op, "weight", weight, 2, "[N, K]")
    check_dims(op, "scale", scale, 2, "[N / bn, K / bk]")
    (m, k), (n, k_w) = a.data.shape, weight.shape
    bn, bk = block
    if k != k_w:
        fail(op, f"a has K = {k}, weight has K = {k_w}")
    if a.data.dtype != E4M3 or weight.dtype != E4M3:
        fail(op, f"a.data and weight must be {E4M3}, got {a.data.dtype} and {weight.dtype}")
    if scale.dtype != torch.float32 or a.scale.dtype != torch.float32:
        fail(op, f"scales must be float32, got {a.scale.dtype} and {scale.dtype}")
    if bn < 1 or bk < 1:
        fail(op, f"weight blocks must be at least 1 x 1, got {block}")
    want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(scale.shape) != want:
        fail(op, f"scale must be {list(want)} for block {block}, got {list(scale.shape)}")
    groups = triton.cdiv(k, a.group)
    if tuple(a.scale.shape) != (m, groups):
        fail(op, f"a.scale must be [{m}, {groups}], got {list(a.scale.shape)}")
    grouped = scale.shape[1] > 1 or groups > 1
    if grouped and (a.group != bk or bk < 32 or bk & (bk - 1)):
        fail(op, f"per-group scales need the activation's group ({a.group}) to be the weight's block width "
                 f"({bk}), a power of two >= 32")  # fmt: skip
    if a.data.stride(-1) != 1 or weight.stride(-1) != 1:
        fail(op, "a.data and weight must have a contiguous last dimension")
    return grouped


def gemm(
    a: Fp8Act, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `reference.gemm`: a new [M, N] tensor in a's dtype, or with `residual`
    ([M, N], a's dtype, consumed) residual + the product, written into residual."""
    op = "fp8 gemm"
    grouped = _check(op, a, weight, scale, block)
    (m, k), n = a.data.shape, weight.shape[0]
    check_same_device(op, a=a.data, a_scale=a.scale, weight=weight, scale=scale)
    check_triton_device(op, weight.device)
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != a.dtype or not bias.is_contiguous()):
        fail(op, f"bias must be a contiguous [{n}] tensor of dtype {a.dtype}")
    if residual is not None:
        check_dims(op, "residual", residual, 2, "[M, N]")
        if tuple(residual.shape) != (m, n) or residual.dtype != a.dtype or residual.stride(-1) != 1:
            fail(op, f"residual must be [{m}, {n}] of dtype {a.dtype} with contiguous rows")
        out = residual
    else:
        out = torch.empty((m, n), dtype=a.dtype, device=weight.device)
    if m == 0 or n == 0:
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if m <= 16 else 128  # few rows: more column blocks, to spread over the SMs
    block_k = block[1] if grouped else min(128, max(32, triton.next_power_of_2(k)))
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a.data, a.scale, weight, scale, bias if bias is not None else out, out, m, n, k,
        a.data.stride(0), a.scale.stride(0), a.scale.stride(1), weight.stride(0), scale.stride(0),
        scale.stride(1), out.stride(0),
        W_ROWS=block[0], GROUPED=grouped, HAS_BIAS=bias is not None, ADD=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=8 if block_m == 128 else 4, num_stages=3,
    )  # fmt: skip
    return out
