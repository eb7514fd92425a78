"""An activation quantized for an FP8 GEMM (`Fp8Act`) and the layout of its scales: what the FP8
quantizers (`fp8/`) and the decode attention kernels that quantize their output for the o projection
(`attention/`) both hand to the GEMM, so it sits below both. Torch only."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["AMAX_FLOOR", "E4M3", "FP8_MAX", "Fp8Act", "scale_buffer"]

E4M3 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(E4M3).max)  # 448
# The smallest absolute maximum a scale is taken from: an all-zero group gets a tiny scale (and zeros),
# never a division by zero.
AMAX_FLOOR = 1e-12


class Fp8Act(NamedTuple):
    """An activation quantized for an FP8 GEMM: data [T, K] e4m3 and scale [T, ceil(K / group)] float32
    (column-major from the Triton quantizers, as cuBLAS's 1x128 scaling reads it); `dtype` is the
    activation's own dtype, the GEMM's output dtype."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def scale_buffer(rows: int, groups: int, device: torch.device) -> torch.Tensor:
    """[rows, groups] float32, column-major (each group's scales of every row contiguous)."""
    return torch.empty((groups, rows), dtype=torch.float32, device=device).t()
