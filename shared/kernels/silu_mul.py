"""Triton SwiGLU activation: silu(gate) * up, read from the fused gate_up projection's output; and
Gemma's GeGLU, gelu_tanh(gate) * up (`gelu_tanh_mul`), the same kernel with the other activation.

A 2-D grid (row, column block) rather than one program per row: at decode the rows are few and long
(64 x 6144), and a row per program would leave most SMs idle. silu is rounded to the dtype before the
multiply, as `F.silu(gate) * up` rounds it.

`silu_mul_rms` also applies the post-attention RMSNorm's row scale, for a model whose norm weight is
folded into gate_up's weight (`Transformer.fold_norms`): every program sums the squares of its
row of the norm's input (a few KB, hot in L2) and scales gate and up by its rsqrt. That is one kernel
where the layer ran two, the norm's and this one.

GELU's tanh approximation, 0.5 g (1 + tanh(z)) with z = sqrt(2/pi) (g + 0.044715 g^3), is computed in
float32 as torch computes it, tanh from exp (Triton has none that the interpreter runs), then rounded
to the dtype. Not as g * sigmoid(2z), the same function: that keeps tiny values where torch's
1 + tanh(z) is exactly 0, far left of 0, and flips a bfloat16 result in eight where this flips one in
two hundred (torch's own unfused tanh flips as many: its fused GELU rounds its own way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._launch import next_pow2
from shared.kernels._norm_checks import check_activation, check_norm_input, check_triton_device, fail
from shared.kernels._round import round_to
from shared.kernels._rows import row_rstd


@triton.jit
def glu(gate, up, dtype: tl.constexpr, GELU: tl.constexpr):
    """act(gate) * up from float32 gate and up, rounded to `dtype` as torch rounds each op: silu, or
    GELU's tanh approximation (GELU)."""
    if GELU:  # torch's formula, its saturation (exact zeros far left) included
        inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
        mag = tl.minimum(tl.abs(inner), 15.0)  # tanh(15) is 1.0 in float32; exp(30) does not overflow
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * mag) + 1.0)
        act = round_to(0.5 * gate * (1.0 + tl.where(inner < 0, -tanh, tanh)), dtype)
    else:
        act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    return round_to(act * up, dtype)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, h_ptr, stride_x, stride_out, stride_h, size, hidden, eps,
    BLOCK: tl.constexpr, RMS: tl.constexpr, BLOCK_H: tl.constexpr, GELU: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        rstd = row_rstd(h_ptr, row, stride_h, hidden, eps, BLOCK_H)
        gate = round_to(gate * rstd, dtype)
        up = round_to(up * rstd, dtype)
    tl.store(out_ptr + row * stride_out + cols, glu(gate, up, dtype, GELU).to(dtype), mask=mask)


def _launch(
    op: str, gate_up: torch.Tensor, h: torch.Tensor | None, eps: float, gelu: bool = False
) -> torch.Tensor:
    check_activation(op, "gate_up", gate_up, 2, "[T, 2I]")
    rows, width = gate_up.shape
    if width % 2:
        fail(op, f"gate_up must hold gate and up halves of equal width, got {width} columns")
    if h is not None:
        check_norm_input(op, h, "gate_up", gate_up, eps)
    check_triton_device(op, gate_up.device)
    size = width // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or size == 0:
        return out
    block = min(1024, next_pow2(size))
    hidden = h.shape[1] if h is not None else 1
    _silu_mul_kernel[(rows, triton.cdiv(size, block))](
        gate_up, out, h if h is not None else gate_up, gate_up.stride(0), out.stride(0),
        h.stride(0) if h is not None else 0, size, hidden, float(eps),
        BLOCK=block, RMS=h is not None, BLOCK_H=next_pow2(hidden), GELU=gelu,
        num_warps=4,
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference.silu_mul`: gate_up [T, 2I] (gate | up) -> [T, I], a new tensor."""
    return _launch("silu_mul", gate_up, None, 0.0)


def silu_mul_rms(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `reference.silu_mul_rms`: gate_up [T, 2I] scaled by each row's rsqrt(mean(x^2)
    + eps) of x [T, H], then `silu_mul`; a new [T, I] tensor."""
    return _launch("silu_mul_rms", gate_up, x, eps)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference.gelu_tanh_mul`: gate_up [T, 2I] (gate | up) -> [T, I]."""
    return _launch("gelu_tanh_mul", gate_up, None, 0.0, gelu=True)


def gelu_tanh_mul_rms(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `reference.gelu_tanh_mul_rms`: `silu_mul_rms` with GELU-tanh."""
    return _launch("gelu_tanh_mul_rms", gate_up, x, eps, gelu=True)
