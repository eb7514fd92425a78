"""Mixture-of-experts kernels: the router (`route.py`, torch), the experts as one fused Triton op
(`fused_moe.py`: align, grouped gate_up GEMM with the activation in its epilogue, grouped down GEMM
weighted by the router, combine) and its torch reference (`reference.py`). README.md has the layouts.

Importing this package never imports triton: `fused_moe_for` loads the Triton module when asked for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from shared.kernels.moe import reference
from shared.kernels.moe.reference import ACTIVATIONS
from shared.kernels.moe.route import SCORINGS, route

__all__ = ["ACTIVATIONS", "SCORINGS", "MoeBackend", "fused_moe_for", "reference", "route"]

MoeBackend = Literal["auto", "torch", "triton"]


def fused_moe_for(device: torch.device, backend: MoeBackend = "auto") -> Callable[..., torch.Tensor]:
    """The experts' op for `device`, with `reference.fused_moe`'s signature: the Triton one on CUDA
    ("auto") or when forced ("triton": on a CPU it needs TRITON_INTERPRET=1), else the torch one."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"fused_moe_for: backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return reference.fused_moe
    from shared.kernels.moe.fused_moe import fused_moe

    return fused_moe
