"""Triton SwiGLU activation: silu(gate) * up, read from the fused gate_up projection's output.

A 2-D grid (row, column block) rather than one program per row: at decode the rows are few and long
(64 x 6144), and a row per program would leave most SMs idle. silu is rounded to the dtype before the
multiply, as `F.silu(gate) * up` rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.attention._launch import next_pow2
from shared.model.kernels._checks import check_activation, check_triton_device, fail
from shared.model.kernels._round import round_to


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * stride_out + cols, round_to(act * up, dtype).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference.silu_mul`: gate_up [T, 2I] (gate | up) -> [T, I], a new tensor."""
    op = "silu_mul"
    check_activation(op, "gate_up", gate_up, 2, "[T, 2I]")
    rows, width = gate_up.shape
    if width % 2:
        fail(op, f"gate_up must hold gate and up halves of equal width, got {width} columns")
    check_triton_device(op, gate_up.device)
    size = width // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or size == 0:
        return out
    block = min(1024, next_pow2(size))
    _silu_mul_kernel[(rows, triton.cdiv(size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block, num_warps=4
    )
    return out
