"""Holding the fused kernels to the torch reference (a uniquely named module, importable from test files)."""

from __future__ import annotations

import torch

# One unit in the last place, relative: the most a float32 sum taken in another order can move a result.
ULP = {torch.float32: 2e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, max_flips: float = 0.01) -> None:
    """Within one ulp everywhere, and for 16-bit dtypes bit-equal almost everywhere.

    The kernels round exactly where torch does, so only a float32 sum (a norm's mean, in another
    order) may move a value across a rounding boundary; a rounding step in the wrong place would
    change far more than `max_flips` of the values.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    ulp = ULP[expected.dtype]
    # Absolute slack scaled to the tensor: RoPE's differences cancel, so a tiny value may be far off
    # relative to itself while its error is an ulp of the operands.
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=2 * ulp, atol=2 * ulp * max(scale, 1e-6))
    if expected.dtype != torch.float32 and expected.numel():
        flips = (actual != expected).float().mean().item()
        assert flips <= max_flips, f"{flips:.2%} of values differ from the reference's rounding"
