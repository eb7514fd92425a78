"""Releasing a programmatic dependent launch early from the Triton kernels that feed a GEMM.

A decode GEMM launched as a programmatic dependent launch (`cute_gemm`) loads its weights before it
waits for the kernel before it, and waits (`griddepcontrol.wait`: that kernel complete, its writes
visible) before it reads anything that kernel wrote. So the kernel before may release it at its very
start: the GEMM's programs are placed as this kernel's last wave drains and stream their weights into
its tail. A successor not launched that way is unaffected: the release is then a no-op.
"""

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def release_dependents(RELEASE: tl.constexpr):
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def release_flag(device: torch.device) -> bool:
    """The kernels' RELEASE constexpr: on a GPU (Hopper's griddepcontrol), never interpreted."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
