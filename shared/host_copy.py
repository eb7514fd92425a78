"""Host-to-device copies that never make the host wait.

A copy from pageable memory blocks the host until the device has taken the bytes; through pinned
memory it is asynchronous, and PyTorch's pinned-block cache does not hand the block out again before
the copy has run, so the caller may rewrite its own host buffer at once.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(host: torch.Tensor, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
    """`host` on `device` (or copied into `into`, a tensor there). On CPU without `into`, `host` itself."""
    if device.type == "cuda":
        host = host.pin_memory()
        return into.copy_(host, non_blocking=True) if into is not None else host.to(device, non_blocking=True)
    return into.copy_(host) if into is not None else host
