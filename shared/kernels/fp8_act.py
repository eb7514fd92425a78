"""The activation an FP8 GEMM takes, quantized per token in column groups (`Fp8Act`): what the FP8
kernels (`fp8/`) pass between a quantizer and its GEMM, and what decode attention can write in place of
its 16-bit output (`attention/_split_k.py`, OUT_FP8). Its own module, below both: attention must not
import the FP8 kernels' package, which imports the model kernels that import attention."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Fp8Act"]


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
