"""The RMSNorm row scale, for kernels that apply a norm folded into the GEMM before them
(`Transformer.fold_norms`): the SwiGLU activation, `rms_scale`, and decode attention's q/k/v."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_row(x_ptr, row, stride, size, BLOCK: tl.constexpr):
    """Row `row` of x (`size` values, BLOCK >= size; 0 past them) in float32."""
    c = tl.arange(0, BLOCK)
    return tl.load(x_ptr + row.to(tl.int64) * stride + c, mask=c < size, other=0.0).to(tl.float32)


@triton.jit
def rstd_of(x, size, eps):
    """rsqrt(mean(x^2) + eps) of a row loaded by `load_row`, as `reference.rms_norm` computes it (up to
    the order of the sum). Apart from the load so that a kernel can issue the load early."""
    return tl.math.rsqrt(tl.sum(x * x, axis=0) / size + eps)


@triton.jit
def row_rstd(x_ptr, row, stride, size, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(x[row]^2) + eps) of a row of `size` values (BLOCK >= size), in float32."""
    return rstd_of(load_row(x_ptr, row, stride, size, BLOCK), size, eps)
