"""Triton per-token activation quantization for the FP8 GEMMs: x [T, K] -> e4m3 [T, K] and one float32
scale per token and `group` columns (the whole row for per-channel weights, 128 for block-scaled
ones). Used where no kernel before the GEMM can do it on the way (the o projection reads attention's
output over a cache in the model's dtype, the down projection SwiGLU's); the norms before q/k/v and
gate/up quantize inside their own kernel (`rms_norm_quant.py`), and attention over an FP8 cache writes
e4m3 codes at V's scale (`fp8_out`, shared/kernels/attention/ops.py).

A 2-D grid (row, chunk of groups): at decode the rows are few, and a program per row would leave most
SMs idle on a long row. Scales are written column-major ([G, T] storage viewed as [T, G]), the layout
cuBLAS's 1x128 block scaling reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._launch import next_pow2
from shared.kernels._norm_checks import check_activation, check_triton_device, fail
from shared.kernels._pdl import pdl_launch, release_next, wait_for_inputs
from shared.kernels.fp8._tile import group_offsets, quantize_groups
from shared.kernels.fp8.reference import E4M3, Fp8Act

__all__ = ["group_launch", "group_tiles", "quantize", "scale_buffer", "warps"]


# The scales' row stride is T, which changes every step: specializing on it would compile mid-traffic.
@triton.jit(do_not_specialize=["stride_sg"])
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_sg, size, group,
    BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    release_next(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    g, cols, mask = group_offsets(group, BLOCK_G, GROUP_P2, tl.program_id(1) * BLOCK_G, size)
    y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(y)
    tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + row + g * stride_sg, scale, mask=g < tl.cdiv(size, group))


def scale_buffer(rows: int, groups: int, device: torch.device) -> torch.Tensor:
    """[rows, groups] float32, column-major (each group's scales of every row contiguous)."""
    return torch.empty((groups, rows), dtype=torch.float32, device=device).t()


def group_tiles(size: int, group: int) -> tuple[int, int, int]:
    """(group, groups per row, padded group width) of a row of `size` values: a group is at most the row."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    group = min(group, size)
    return group, triton.cdiv(size, group), next_pow2(group)


def warps(block: int) -> int:
    """Warps of a program holding `block` values (as `rms_norm.py` sizes its row programs)."""
    return min(16, max(1, block // 512))


def quantize(x: torch.Tensor, group: int) -> Fp8Act:
    """Triton version of `reference.quantize`: x [T, K] (rows may be strided) -> Fp8Act."""
    op = "fp8 quantize"
    check_activation(op, "x", x, 2, "[T, K]")
    check_triton_device(op, x.device)
    rows, size = x.shape
    if size == 0:
        fail(op, "x has no columns")
    out, grid, consts = group_launch(op, rows, size, group, x.device, x.dtype)
    if rows:
        _quant_kernel[grid](
            x, out.data, out.scale, x.stride(0), out.data.stride(0), out.scale.stride(1), size, out.group,
            **consts, **pdl_launch(x.device, rows),
        )  # fmt: skip
    return out


def group_launch(
    op: str, rows: int, size: int, group: int, device: torch.device, dtype: torch.dtype
) -> tuple[Fp8Act, tuple[int, int], dict[str, int]]:
    """A grouped quantizer's launch for `rows` rows of `size` values (`quantize`, `glu_quant`): its
    output to fill (e4m3 data, column-major scales), its (row, chunk of groups) grid, and the
    constants BLOCK_G, GROUP_P2 and num_warps of programs of about 1024 values."""
    group, groups, width = group_tiles(size, group)
    if width > 65536:
        fail(op, f"groups of {group} values do not fit one program (at most 65536)")
    out = Fp8Act(
        torch.empty((rows, size), dtype=E4M3, device=device), scale_buffer(rows, groups, device), group, dtype
    )
    per_program = min(max(1, 1024 // width), next_pow2(groups))
    grid = (rows, triton.cdiv(groups, per_program))
    return out, grid, {"BLOCK_G": per_program, "GROUP_P2": width, "num_warps": warps(per_program * width)}
