"""Rounding a float32 value to the activation dtype, as a torch op on that dtype rounds its result."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rounding_options(dtype: torch.dtype) -> dict[str, bool]:
    """Launch options for a kernel that rounds products with `round_to` in `dtype`.

    float16 rounds by casts, and compiling with FP fusion (contraction) lets the backend narrow a
    rounded product to a float16 multiply and then fuse it, widened, into the add or subtract after it
    (one float32 FMA): the product's rounding is gone. On an H200, RoPE's `round(x1 c) - round(x2 s)`
    differed from torch's float16 ops in 26% of values that way (tests/model/test_model_kernels.py).
    bfloat16 rounds by bits, which nothing fuses, so only float16 kernels compile without fusion.
    """
    return {"enable_fp_fusion": dtype != torch.float16}


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x (float32) rounded to nearest-even in `dtype`, returned as float32 (exact in `dtype`).

    bf16 is rounded by bits: a GPU rounds a float32 -> bf16 cast to nearest, but Triton's interpreter
    (where the CPU tests run) truncates, which would hide real mismatches behind a one-ulp tolerance.
    Storing the result with a plain `.to(dtype)` is then exact on both.
    """
    # One return at the end: a compiled Triton function may not return from inside an if.
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, u.to(tl.float32, bitcast=True))  # NaN payloads must not carry
    elif dtype == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y
