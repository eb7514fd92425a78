"""Host-to-device copies that never make the host wait.

A copy from pageable memory blocks the host until the device has taken the bytes; through pinned
memory it is asynchronous, and PyTorch's pinned-block cache does not hand the block out again before
the copy has run, so the caller may rewrite its own host buffer at once.
"""

from __future__ import annotations

import torch

__all__ = ["reserve_pinned", "to_device"]


def to_device(host: torch.Tensor, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
    """`host` on `device` (or copied into `into`, a tensor there). On CPU without `into`, `host` itself."""
    if device.type == "cuda":
        host = host.pin_memory()
        return into.copy_(host, non_blocking=True) if into is not None else host.to(device, non_blocking=True)
    return into.copy_(host) if into is not None else host


def reserve_pinned(nbytes: int, count: int = 2) -> None:
    """Have PyTorch's pinned-block cache hold `count` blocks of at least `nbytes`, so that the copies
    that will need them do not wait for a fresh pinned allocation (cudaHostAlloc is slow, and would
    land on the step that first uploads a batch that large)."""
    if nbytes > 0 and torch.cuda.is_available():
        blocks = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        del blocks  # back to the cache, not to the driver
