"""A barrier across every program of a kernel's grid, for an epilogue that needs what all of them
computed (`skinny_gemm`'s norm: a row's sum of squares is spread over every column block).

Every program must be resident at once, or the ones spinning wait forever for ones that cannot be
placed: a caller launches at most one program per SM (`fits`), and cooperatively (`cooperative`:
the driver refuses a grid that cannot all be resident, where a plain launch would hang). Under
programmatic dependent launch that still holds: the kernel after this one is placed only once every
program of this one has released it, so all of them are on the GPU by then. Triton's interpreter runs
programs one after another, so there is no barrier there (`fits` is False).

The counters (`counters`): [0] the programs arrived, [1] the barriers passed. The last program to
arrive sets [0] back to zero and then bumps [1]; the others spin until [1] moves past the value they
read before arriving. [0] is zero whenever no barrier is in flight, so the counters need no reset
between launches, and [1] may wrap.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from shared.kernels._launch import interpreting
from shared.kernels._tickets import tickets

__all__ = ["cooperative", "counters", "fits", "grid_sync"]


@triton.jit
def grid_sync(counters_ptr, programs):
    """Returns once every one of the grid's `programs` programs has called it; each program's writes
    before the call are visible to every program after it (read them with `.cg` loads: L1 is not
    coherent across SMs)."""
    tl.debug_barrier()  # every thread's writes issued before the arrival releases them
    passed = tl.atomic_add(counters_ptr + 1, 0)
    if tl.atomic_add(counters_ptr, 1) == programs - 1:
        tl.atomic_xchg(counters_ptr, 0)
        tl.atomic_add(counters_ptr + 1, 1)
    else:
        while tl.atomic_add(counters_ptr + 1, 0) == passed:
            pass
    tl.debug_barrier()


def counters(device: torch.device) -> torch.Tensor:
    """The barrier's two int32 counters for the current stream of `device`."""
    return tickets(device, 2, 2, use="grid_sync")


def fits(device: torch.device, programs: int) -> bool:
    """Whether a grid of `programs` programs can wait at `grid_sync`: a CUDA device with at least as
    many SMs, outside the interpreter."""
    return device.type == "cuda" and not interpreting() and programs <= _sms(device)


def cooperative() -> dict[str, Any]:
    """Launch options asking the driver for a cooperative launch, where this Triton takes them."""
    return {"launch_cooperative_grid": True} if _takes_cooperative() else {}


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _takes_cooperative() -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_cooperative_grid" in CUDAOptions.__dataclass_fields__
