"""Zeroed int32 ticket counters for kernels whose last program of a group finishes the group's work
(the skinny GEMM's split-K reduction, the split argmax): each launch leaves its counters at zero again.

One set per (device, stream): launches on one stream are ordered, two threads' streams get two sets.
A set that grows keeps its old buffer alive (a CUDA graph captured with it replays into it). Inside a
graph capture, a stream whose set is large enough (an eager warm-up on the capture stream made it)
uses it; otherwise the call zeroes counters of its own, and that memset becomes part of the graph.
"""

from __future__ import annotations

import torch

_sets: dict[tuple[torch.device, int], torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def tickets(device: torch.device, count: int, minimum: int = 1024) -> torch.Tensor:
    """At least `count` zeroed int32 counters for the current stream of `device`."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    t = _sets.get(key)
    if t is not None and t.numel() >= count:
        return t
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)  # zeroed on every replay
    if t is not None:
        _retired.append(t)
    t = _sets[key] = torch.zeros(max(count, minimum), dtype=torch.int32, device=device)
    return t
