"""The side stream that `invariants.concurrent_checks()` runs a block's checks on.

Inside a block (per thread and device) a CUDA check forks: the Checker's side stream waits for an
event recorded on the current stream, then the kernel is launched on the side stream. The block's
end joins once: the current stream waits for the side stream. So a check runs beside the kernels that
follow it instead of in series with them, still after everything enqueued before it.

Memory: the tensors a forked check reads (the predicate's, a lambda's temporaries, the kernel's 2-D
views) were allocated on the current stream. Freed there while the side stream may still read them,
the caching allocator could hand their blocks to a later kernel of the block (eagerly, or in a graph's
private pool during capture). The branch holds a reference to them until the join, after which the current
stream is ordered behind every read. Holding beats `record_stream`: no allocator events, and the same
behaviour eager and under capture. The side stream itself never allocates.

Capture: the side stream exists before capture (like the slab). A fork inside capture pulls the side
stream into the capture through the event; the join rejoins it, as capture requires of every forked
stream, which is why the block must lie wholly inside or wholly outside a capture.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from invariants.blocks import Blocks

__all__ = ["SideBranch", "depth", "enter", "leave", "note_fork"]


class _Joinable(Protocol):
    def join(self) -> None: ...


# Branches forked onto since the outermost block of their device opened (any Checker, not only the
# process's: the block joins whatever its checks forked).
_blocks: Blocks[_Joinable] = Blocks()
depth, enter, leave, note_fork = _blocks.depth, _blocks.enter, _blocks.leave, _blocks.note


class _ThreadBranch(threading.local):
    """One thread's un-joined forks (streams are per thread: so is the block that forks onto them)."""

    def __init__(self) -> None:
        self.forked = False
        self.held: list[tuple[torch.Tensor, ...]] = []


class SideBranch:
    """A Checker's side stream and each thread's un-joined forks onto it."""

    def __init__(self, device: torch.device) -> None:
        # Highest priority: a check's few blocks are scheduled before the step's pending ones, so
        # it is done long before the join waits for it (graph replays ignore stream priorities).
        # Priority streams come from their own pool, so it is never a capture's or a warm-up's stream.
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.device = device
        self._local = _ThreadBranch()

    def fork(self) -> torch.cuda.Stream:
        """Order the side stream after all work enqueued so far on the current stream; return it."""
        # wait_stream records a fresh event each time: PyTorch's own idiom for multi-stream capture
        # (a reused event last recorded inside a capture is one the driver restricts).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        b = self._local
        if not b.forked:
            b.forked = True  # under capture the side stream is now part of it: it must rejoin
            note_fork(self.device, self)
        return self.stream

    def hold(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._local.held.append(tensors)

    def join(self) -> None:
        """Make the current stream wait for this thread's forked checks; no-op when there are none."""
        b = self._local
        if not b.forked:
            return
        try:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        finally:
            b.forked = False
            b.held.clear()  # the current stream is ordered after the reads: its blocks may be reused
