"""Triton SwiGLU / GeGLU that writes its output quantized for the FP8 down projection: act(gate) * up
(`shared/kernels/silu_mul.py`'s `glu`, rounded as the layer's activation rounds it), then each
token's `group`-column groups to e4m3 as `reference.quantize` does them. One kernel where the layer
would run two (the activation and `quant.quantize`), and the activation never goes to memory in 16
bits.

The grid is `quant.py`'s: (row, chunk of groups), so a per-token scale (one group: the whole row) is
one program a row, and 128-column groups spread a row over several programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._norm_checks import check_activation, check_triton_device, fail
from shared.kernels._pdl import pdl_launch, release_next, wait_for_inputs
from shared.kernels.fp8._tile import group_offsets, quantize_groups
from shared.kernels.fp8.quant import group_launch
from shared.kernels.fp8.reference import Fp8Act
from shared.kernels.silu_mul import glu

__all__ = ["glu_quant"]


@triton.jit(do_not_specialize=["stride_sg"])
def _glu_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_sg, size, group,
    BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    release_next(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    g, cols, mask = group_offsets(group, BLOCK_G, GROUP_P2, tl.program_id(1) * BLOCK_G, size)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(glu(gate, up, x_ptr.dtype.element_ty, GELU))  # 0 where masked
    tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + row + g * stride_sg, scale, mask=g < tl.cdiv(size, group))


def glu_quant(gate_up: torch.Tensor, group: int, gelu: bool = False) -> Fp8Act:
    """Triton version of `reference.glu_quant`: gate_up [T, 2I] (gate | up) -> Fp8Act [T, I] of
    silu(gate) * up (gelu: GELU-tanh), `group` columns a scale."""
    op = "glu_quant"
    check_activation(op, "gate_up", gate_up, 2, "[T, 2I]")
    check_triton_device(op, gate_up.device)
    rows, width = gate_up.shape
    if width % 2 or width == 0:
        fail(op, f"gate_up must hold gate and up halves of equal, non-zero width, got {width} columns")
    size = width // 2
    out, grid, consts = group_launch(op, rows, size, group, gate_up.device, gate_up.dtype)
    if rows:
        _glu_quant_kernel[grid](
            gate_up, out.data, out.scale, gate_up.stride(0), out.data.stride(0), out.scale.stride(1), size,
            out.group, GELU=gelu, **consts, **pdl_launch(gate_up.device, rows),
        )  # fmt: skip
    return out
