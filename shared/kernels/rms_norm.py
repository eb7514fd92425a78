"""Triton RMSNorm, optionally fused with the residual add that precedes it.

One program per row holds the whole row in registers: the sum of squares and the scaling need the row
twice, and reading it once from HBM is the point. With a residual, the program writes both outputs a
decoder layer needs: the new residual stream (x + residual, rounded to the dtype, as a torch add
would) and its norm. Rounding follows `reference.rms_norm` step for step, so results match it up to
the order of the float32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._launch import next_pow2
from shared.kernels._norm_checks import (
    check_activation,
    check_eps,
    check_norm_input,
    check_same_device,
    check_triton_device,
    check_weight,
    fail,
)
from shared.kernels._round import round_to
from shared.kernels._rows import row_rstd


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out, size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # Rounded before it is normed: the model norms the residual stream it stores.
        h = round_to(h + r, dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, h.to(dtype), mask=mask)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / size + eps)
    # Hugging Face casts the normed row to the activation dtype before the weight multiplies it.
    h = round_to(h * rstd, dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(h * w, dtype).to(dtype), mask=mask)


def _launch(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_activation(op, "x", x, 2, "[T, H]")
    rows, size = x.shape
    check_weight(op, "weight", weight, size, x.dtype)
    check_eps(op, eps)
    if residual is not None:
        check_activation(op, "residual", residual, 2, "[T, H]")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            fail(op, f"residual {tuple(residual.shape)} {residual.dtype} != x {tuple(x.shape)} {x.dtype}")
        check_same_device(op, x=x, residual=residual, weight=weight)
    else:
        check_same_device(op, x=x, weight=weight)
    check_triton_device(op, x.device)
    out = torch.empty((rows, size), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if rows == 0:
        return out, res_out
    block = next_pow2(size)
    if block > 65536:
        fail(op, f"rows of {size} values do not fit one program (at most 65536)")
    res, dst = (residual, res_out) if residual is not None else (x, out)  # unread when HAS_RESIDUAL=False
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, dst,
        x.stride(0), res.stride(0), out.stride(0), dst.stride(0), size, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `reference.rms_norm` for x [T, H] (rows may be strided), weight [H]."""
    return _launch("rms_norm", x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.add_rms_norm`: (rms_norm(residual + x), residual + x), new tensors."""
    out, res_out = _launch("add_rms_norm", x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


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
