"""Programmatic dependent launch (PDL; Hopper, compute capability 9.0, and later) for the FP8 decode
step's Triton kernels.

A decode step of an FP8 model is a chain of short kernels, nine a layer (two norms that quantize, the
q/k/v, o, gate/up and down GEMMs, attention, the SwiGLU and attention-output quantizers), and each
boundary leaves SMs idle while the next kernel launches and ramps up. A kernel launched with PDL
(`launch_pdl`) may be placed on the GPU once every program of the kernel before it has released it
(`release_next`), and it waits inside (`wait_for_inputs`: the kernel before it complete, its writes
visible) before it reads or writes anything of the step, so results are bit for bit those of plain
launches. A kernel launched without it, or after one that never releases (cuBLAS), runs as always; a
release with no PDL launch after it does nothing.

Where each kernel releases its successor, and at which batches PDL is on at all (`_faster`), is what
the measurements chose (docs/performance.md): the quantizers and attention release as they start,
the skinny GEMM after its K loop, so that the GEMM's successor fills its tail rather than holding SM
slots through its stream. A bf16 model's decode GEMMs launch plainly, so the chain of a bf16 model
runs as without PDL.

`PDSERVE_PDL=0` launches every kernel plainly: an A/B switch, and a way out should a driver misbehave.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from shared.kernels._launch import interpreting

__all__ = ["pdl_launch", "release_next", "wait_for_inputs"]


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Waits until the kernel before this one is complete and its writes visible. What a kernel does
    before this call may only read what no kernel of the step writes (weights)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Lets the next kernel be placed once every program of this one has called it (or finished)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def pdl_launch(device: torch.device, rows: int, wanted: bool = True) -> dict[str, Any]:
    """The launch arguments of a kernel taking the `PDL` constexpr, for a call over `rows` rows (a
    decode step's batch): PDL when `wanted` and the batch is one where it measured faster, on a CUDA
    device of compute capability 9.0 or later, unless interpreted or `PDSERVE_PDL=0`."""
    if not (wanted and _faster(rows)) or device.type != "cuda" or interpreting():
        return {"PDL": False}
    if os.environ.get("PDSERVE_PDL") == "0":
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _hopper(index) else {"PDL": False}


def _faster(rows: int) -> bool:
    """The decode batches PDL measured faster at (an 8B-wide FP8 model on an H200, docs/performance.md):
    64 rows (3.5-4%) and 1 or 2 (5.5%). At 8, 16 and 32 rows it was 3.5-11% slower, so from 3 to 32
    rows the kernels launch plainly; above 64 rows (prefill) too."""
    return rows <= 2 or 32 < rows <= 64


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)
