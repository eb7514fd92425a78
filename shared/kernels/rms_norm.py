"""Triton RMSNorm, and the row scale of a norm folded into the GEMM before it (`rms_scale`).

One program per row holds the whole row in registers: the sum of squares and the scaling need the row
twice, and reading it once from HBM is the point. Rounding follows `reference.rms_norm` step for step,
so results match it up to the order of the float32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._launch import next_pow2
from shared.kernels._norm_checks import (
    check_activation,
    check_norm_input,
    check_rms_norm,
    check_triton_device,
    fail,
)
from shared.kernels._round import round_to
from shared.kernels._rows import row_rstd


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, size, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / size + eps)
    # Hugging Face casts the normed row to the activation dtype before the weight multiplies it.
    h = round_to(h * rstd, dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(h * w, dtype).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `reference.rms_norm` for x [T, H] (rows may be strided), weight [H]."""
    op = "rms_norm"
    rows, size = check_rms_norm(op, x, weight, eps)
    out = torch.empty((rows, size), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = next_pow2(size)
    if block > 65536:
        fail(op, f"rows of {size} values do not fit one program (at most 65536)")
    _rms_norm_kernel[(rows,)](
        x, weight, out, x.stride(0), out.stride(0), size, float(eps),
        BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return out


@triton.jit
def _rms_scale_kernel(
    y_ptr, x_ptr, out_ptr, stride_y, stride_x, stride_out, width, size, eps,
    BLOCK: tl.constexpr, BLOCK_X: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    rstd = row_rstd(x_ptr, row, stride_x, size, eps, BLOCK_X)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(y * rstd, dtype).to(dtype), mask=mask)


def rms_scale(y: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `reference.rms_scale`: y [T, N] with each row times rsqrt(mean(x^2) + eps) of
    x [T, H]'s row, a new tensor. (A GEMM of x whose weight holds the norm's weight, scaled as if it
    had read norm(x).)"""
    op = "rms_scale"
    check_activation(op, "y", y, 2, "[T, N]")
    check_norm_input(op, x, "y", y, eps)
    check_triton_device(op, y.device)
    rows, width = y.shape
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if rows == 0 or width == 0:
        return out
    block = min(1024, next_pow2(width))
    _rms_scale_kernel[(rows, triton.cdiv(width, block))](
        y, x, out, y.stride(0), x.stride(0), out.stride(0), width, x.shape[1], float(eps),
        BLOCK=block, BLOCK_X=next_pow2(x.shape[1]), num_warps=4,
    )  # fmt: skip
    return out
