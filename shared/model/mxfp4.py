"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts: each 32 values of a row
are 4-bit e2m1 codes (two a byte, the low nibble first) sharing one e8m0 scale (2^(s - 127)).
`*_blocks` [..., G, 16] uint8 and `*_scales` [..., G] uint8 become [..., G * 32] values, exactly (every
e2m1 value times a power of two is a float32). pdserve dequantizes them at load and serves the
experts in the model's dtype."""

from __future__ import annotations

import torch

__all__ = ["dequantize_mxfp4"]

# e2m1: sign, 2 exponent bits, 1 mantissa bit
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32 [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks must be [..., G, 16] with scales [..., G], got {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    values = torch.ldexp(lut[codes.long()], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)
