"""The FP8 quantizers' (`quant.py`, `rms_norm_quant.py`, `glu_quant.py`) tiles of activation groups;
`quantize_groups` (in `shared/kernels/_round.py`, where the skinny GEMM's epilogue takes it too) does to
each group what `reference.quantize` does, bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels._round import quantize_groups

__all__ = ["group_offsets", "quantize_groups"]


@triton.jit
def group_offsets(group, BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, first, size):
    """Columns [BLOCK_G, GROUP_P2] of groups first .. first + BLOCK_G - 1 of a row of `size` values
    (`group` columns each, GROUP_P2 >= group), and which of them exist."""
    g = first + tl.arange(0, BLOCK_G)
    c = tl.arange(0, GROUP_P2)
    cols = g[:, None] * group + c[None, :]
    return g, cols, (c[None, :] < group) & (cols < size)
