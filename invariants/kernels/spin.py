"""A one-thread kernel that holds its stream until the host releases it (the sync probe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["max_iters"])
def _spin(flag_ptr, max_iters):
    i = 0
    while (tl.load(flag_ptr, volatile=True) == 0) & (i < max_iters):
        i += 1


def hold(flag: torch.Tensor, max_iters: int = 200_000_000) -> None:
    """Enqueue a spin on the current stream that ends once `flag[0]` becomes non-zero."""
    if flag.dtype != torch.int32 or flag.numel() != 1 or not flag.is_cuda:
        raise ValueError("hold() needs a one-element int32 CUDA tensor")
    _spin[(1,)](flag, max_iters, num_warps=1)
