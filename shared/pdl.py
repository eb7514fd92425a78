"""Programmatic dependent launch (PDL; Hopper and later) for the decode step's Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
running; it waits inside (`gdc_start`) before it reads or writes anything an earlier kernel of the
step produces or reads, so results are bit for bit those of plain launches. Each kernel also
releases its successor as it starts, so the successor's launch and ramp overlap its own tail: a
decode step is a chain of ~280 short kernels, and each boundary costs a few microseconds of idle
SMs. Measured with `bench/decode_layer_pdl.py` and `bench/engine.py` (docs/benchmarks.md).

Only Triton kernels take part: a cuBLAS kernel neither releases early nor waits in-kernel, so the
chain gains most when the decode GEMMs are Triton's too (`skinny_gemm`). `PDSERVE_PDL=0` turns it
off (an A/B switch, and a way out should a driver misbehave).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["gdc_start", "pdl_args"]


@triton.jit
def gdc_start(PDL: tl.constexpr):
    """Release the next kernel, then wait until the previous one's writes are visible. Everything a
    kernel does before this call may only read what no kernel of the step writes (weights)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.cache
def _enabled(index: int) -> bool:
    if os.environ.get("PDSERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict[str, Any]:
    """The launch arguments of a kernel that calls `gdc_start(PDL)`: PDL on for a CUDA device of
    compute capability 9.0 or later (unless `PDSERVE_PDL=0`), off elsewhere (CPU, the interpreter)."""
    if device.type != "cuda":
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _enabled(index) else {"PDL": False}
