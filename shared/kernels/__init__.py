"""Fused elementwise kernels of the decoder (RMSNorm + residual, RoPE + q/k norm, SwiGLU) behind one
seam, `ModelKernels`; `reference.py` holds the torch versions they are tested against.

Importing this package never imports triton: the kernel modules load when `TritonKernels` is built.
"""

from __future__ import annotations

from shared.kernels.ops import (
    Backend,
    Gemm,
    KVStore,
    ModelKernels,
    TorchKernels,
    TritonKernels,
    kernels_for,
)

__all__ = ["Backend", "Gemm", "KVStore", "ModelKernels", "TorchKernels", "TritonKernels", "kernels_for"]
