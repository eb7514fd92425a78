"""Quantizing tiles of activations to e4m3 inside a Triton kernel, shared by the FP8 quantizers
(`fp8/quant.py`, `fp8/rms_norm_quant.py`, `fp8/glu_quant.py`) and the decode attention kernels that
quantize their output for the o projection (`attention/_split_k.py`): what `fp8/reference.py`
`quantize` does to each group, bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels._round import to_e4m3

FP8_MAX = tl.constexpr(448.0)  # fp8_act.FP8_MAX
AMAX_FLOOR = tl.constexpr(1e-12)  # fp8_act.AMAX_FLOOR


@triton.jit
def group_offsets(group, BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, first, size):
    """Columns [BLOCK_G, GROUP_P2] of groups first .. first + BLOCK_G - 1 of a row of `size` values
    (`group` columns each, GROUP_P2 >= group), and which of them exist."""
    g = first + tl.arange(0, BLOCK_G)
    c = tl.arange(0, GROUP_P2)
    cols = g[:, None] * group + c[None, :]
    return g, cols, (c[None, :] < group) & (cols < size)


@triton.jit
def scale_of(amax):
    """(scale, 1 / scale) of a group whose absolute maximum is `amax`: the maximum lands on 448. IEEE
    divisions, as torch's."""
    scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    return scale, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def quantize_groups(y):
    """y [G, C] float32 (0 where no value) -> (e4m3 [G, C], scale [G]): each row of the tile is a group."""
    scale, inv = scale_of(tl.max(tl.abs(y), axis=1))
    return to_e4m3(y, inv[:, None], tl.float8e4nv), scale


@triton.jit
def quantize_tile(y):
    """y [R, C] float32 (0 where no value) -> (e4m3 [R, C], scale): the whole tile is one group."""
    scale, inv = scale_of(tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    return to_e4m3(y, inv, tl.float8e4nv), scale
