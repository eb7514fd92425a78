"""Rounding a float32 value to the activation dtype, as a torch op on that dtype rounds its result."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def rounding_options(dtype: torch.dtype) -> dict[str, bool]:
    """Launch options for a kernel that rounds products with `round_to` in `dtype`.

    float16 rounds by casts, and compiling with FP fusion (contraction) lets the backend narrow a
    rounded product to a float16 multiply and then fuse it, widened, into the add or subtract after it
    (one float32 FMA): the product's rounding is gone, and RoPE's `round(x1 c) - round(x2 s)` then
    differs from torch's float16 ops in a large share of values (tests/model/test_model_kernels.py).
    bfloat16 rounds in inline assembly (by bits in the interpreter), which nothing fuses, so only
    float16 kernels compile without fusion.
    """
    return {"enable_fp_fusion": dtype != torch.float16}


# Read when triton is imported, as triton itself reads it: a process interprets every kernel or none.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x (float32) rounded to nearest-even in `dtype`, returned as float32 (exact in `dtype`).

    On a GPU bf16 is rounded by one `cvt.rn.bf16.f32` in inline assembly, which the compiler cannot
    see through: as casts, LLVM narrows a rounded product to a bf16 multiply and fuses it into the add
    after it (`fma.rn.bf16`, the float16 hazard `rounding_options` describes), and the product's
    rounding is gone. Triton's interpreter (where the CPU tests run) has no inline assembly and
    truncates a cast, which would hide real mismatches behind a one-ulp tolerance, so there bf16 is
    rounded by bits: the same result (RNE, subnormals and overflow alike) in six instructions where
    the GPU takes two, and decode attention's prologue rounds tens of values a thread.
    Storing the result with a plain `.to(dtype)` is then exact on both.
    """
    # One return at the end: a compiled Triton function may not return from inside an if.
    if dtype == tl.bfloat16 and not _INTERPRETED:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 t; .reg .b16 z; mov.b16 z, 0; cvt.rn.bf16.f32 t, $1; mov.b32 $0, {z, t}; }",
            "=r,r",
            [x],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    elif dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, u.to(tl.float32, bitcast=True))  # NaN payloads must not carry
    elif dtype == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def to_e4m3(x, inv_scale, dtype: tl.constexpr):
    """x (float32) times inv_scale, saturated to +-448 and rounded to nearest-even in e4m3 (`dtype`, the
    FP8 cache's float8e4nv); NaN stays NaN: what `shared/kernels/kv_quant.py` `quantize` stores, bit
    for bit.

    On a GPU the cast after the clamp is one `cvt.rn.satfinite` (round to nearest-even). The
    interpreter's float8 cast neither rounds to nearest-even nor carries a rounded mantissa into the
    exponent (7.94 becomes 4), and turns NaN into 384, so there the value is rounded by bits first
    (3 mantissa bits; e4m3's subnormals are multiples of 2^-9) and the cast is exact.
    """
    y = tl.clamp(x * inv_scale, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if _INTERPRETED:
        u = y.to(tl.uint32, bitcast=True)
        normal = ((u & 0x7FFFFFFF) >= 0x3C800000).to(tl.int1)  # |y| >= 2^-6, e4m3's smallest normal
        r = ((u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        s = ((tl.abs(y) * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)  # the float32 add rounds
        s = (s.to(tl.uint32, bitcast=True) | (u & 0x80000000)).to(tl.float32, bitcast=True)
        nan = tl.full(y.shape, 0x7F, tl.uint8).to(dtype, bitcast=True)
        q = tl.where(y != y, nan, tl.where(normal, r, s).to(dtype))
    else:
        q = y.to(dtype)
    return q


@triton.jit
def to_output(x, dtype: tl.constexpr):
    """x (float32) cast to an output's `dtype`; an e4m3 output (codes at scale 1: an attention output in
    V's codes, `attention/_split_k.py`) saturates and rounds to nearest-even as `to_e4m3` does."""
    return to_e4m3(x, 1.0, dtype) if dtype == tl.float8e4nv else x.to(dtype)
