"""Every kernel of pdserve, each with a torch reference and a wrapper that checks shapes, dtypes and
devices (never values): attention (`attention/`), the decoder's norms, RoPE, SwiGLU and GEMMs behind
one seam (`ModelKernels`, `ops.py`; torch versions in `reference.py`), the greedy argmax, sampling,
the decode inputs (`token_table.py`, `decode_advance.py`) and the KV row copy of the cuda_ipc
transfer. The layer below the model and the engine: it imports neither.

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
