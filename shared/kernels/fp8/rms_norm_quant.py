"""Triton RMSNorm that writes its output quantized for the FP8 GEMM after it: the input norm before
q/k/v and the post-attention norm before gate/up, in a model whose projections are FP8.

The norm kernel already holds the whole row (`rms_norm.py`: one program a row), so taking each group's
absolute maximum and writing e4m3 plus the scales costs the norm's own pass: the GEMM's activation
quantization is free. Rounding follows `reference.rms_norm_quant`: the normed row rounded to the
activation dtype as the layer's norm would give it, then quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._norm_checks import check_rms_norm, fail
from shared.kernels._pdl import pdl_launch, release_next, wait_for_inputs
from shared.kernels._round import round_to
from shared.kernels.fp8._tile import group_offsets, quantize_groups
from shared.kernels.fp8.quant import group_tiles, scale_buffer, warps
from shared.kernels.fp8.reference import E4M3, Fp8Act

__all__ = ["rms_norm_quant"]


@triton.jit(do_not_specialize=["stride_sg"])
def _rms_norm_quant_kernel(
    x_ptr, w_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_sg, size, group, eps,
    BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    release_next(PDL)
    g, cols, mask = group_offsets(group, BLOCK_G, GROUP_P2, 0, size)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(tl.sum(h * h, axis=1), axis=0) / size + eps)
    h = round_to(h * rstd, dtype)  # Hugging Face rounds the normed row before the weight multiplies it
    q, scale = quantize_groups(round_to(h * w, dtype))
    tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + row + g * stride_sg, scale, mask=g < tl.cdiv(size, group))


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int) -> Fp8Act:
    """Triton version of `reference.rms_norm_quant`: x [T, H] (rows may be strided), weight [H] ->
    Fp8Act of the normed rows, `group` columns a scale."""
    op = "rms_norm_quant"
    rows, size = check_rms_norm(op, x, weight, eps)
    if size == 0:
        fail(op, "x has no columns")
    group, groups, width = group_tiles(size, group)
    block_g = triton.next_power_of_2(groups)
    if block_g * width > 65536:
        fail(op, f"rows of {size} values do not fit one program (at most 65536)")
    q = torch.empty((rows, size), dtype=E4M3, device=x.device)
    scale = scale_buffer(rows, groups, x.device)
    if rows:
        _rms_norm_quant_kernel[(rows,)](
            x, weight, q, scale, x.stride(0), q.stride(0), scale.stride(1), size, group, float(eps),
            BLOCK_G=block_g, GROUP_P2=width, num_warps=warps(block_g * width),
            **pdl_launch(x.device, rows),
        )  # fmt: skip
    return Fp8Act(q, scale, group, x.dtype)
