"""FP8 (e4m3) weights and activations: the torch reference (`reference.py`: block quantize and
dequantize, the scaled GEMM), the Triton quantizers (`quant.py`, `rms_norm_quant.py`: the norm that
writes FP8 for the GEMM after it), the Triton scaled GEMM (`gemm.py`), cuBLASLt's through
`torch._scaled_mm` (`scaled_mm.py`), and the `ModelKernels` of a model with FP8 projections (`ops.py`).

Importing this package never imports triton: the kernel modules load when `Fp8TritonKernels` is built.
"""

from __future__ import annotations

from shared.kernels.fp8.ops import Fp8Kernels, Fp8Layer, Fp8TorchKernels, Fp8TritonKernels, fp8_kernels_for
from shared.kernels.fp8.reference import E4M3, FP8_MAX, Fp8Act, dequantize, quantize, quantize_weight

__all__ = [
    "E4M3", "FP8_MAX", "Fp8Act", "Fp8Kernels", "Fp8Layer", "Fp8TorchKernels", "Fp8TritonKernels",
    "dequantize", "fp8_kernels_for", "quantize", "quantize_weight",
]  # fmt: skip
