"""Quantizing a tile of activation groups to e4m3, shared by the FP8 quantizers (`quant.py`,
`rms_norm_quant.py`): what `reference.quantize` does to each group, bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels._round import to_e4m3

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-12)  # reference.AMAX_FLOOR


@triton.jit
def group_offsets(group, BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, first, size):
    """Columns [BLOCK_G, GROUP_P2] of groups first .. first + BLOCK_G - 1 of a row of `size` values
    (`group` columns each, GROUP_P2 >= group), and which of them exist."""
    g = first + tl.arange(0, BLOCK_G)
    c = tl.arange(0, GROUP_P2)
    cols = g[:, None] * group + c[None, :]
    return g, cols, (c[None, :] < group) & (cols < size)


@triton.jit
def quantize_groups(y):
    """y [G, C] float32 (0 where no value) -> (e4m3 [G, C], scale [G]): each row of the tile is a group,
    scaled so that its absolute maximum lands on 448. IEEE divisions, as torch's."""
    amax = tl.max(tl.abs(y), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return to_e4m3(y, inv[:, None], tl.float8e4nv), scale
