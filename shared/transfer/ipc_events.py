"""Interprocess CUDA events, the only ordering between prefill's writes and decode's reads (cuda_ipc).

One side records an event on its stream and sends the 64-byte handle; the other opens it once and makes
its own stream wait on it. Neither host ever waits.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["EventRing", "OpenedEvents"]


class EventRing:
    """Interprocess events reused in turn: a peer keeps the handles it has opened (OpenedEvents).

    Re-recording an event a peer has not waited on yet only makes that wait later, never wrong.
    """

    def __init__(self, device: torch.device, size: int = 256) -> None:
        self.device = device
        with torch.cuda.device(device):
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(size)]
            self._handles = [bytes(e.ipc_handle()) for e in self._events]
        self._next = 0

    def record(self) -> bytes:
        """Record on the current stream; the handle a peer waits on."""
        i, self._next = self._next, (self._next + 1) % len(self._events)
        self._events[i].record(torch.cuda.current_stream(self.device))
        return self._handles[i]


class OpenedEvents:
    """A peer's interprocess events, opened once each; `wait` orders this stream after one."""

    def __init__(self, device: torch.device, limit: int = 4096) -> None:
        self.device, self.limit = device, limit
        self._opened: OrderedDict[bytes, torch.cuda.Event] = OrderedDict()

    def wait(self, handle: bytes) -> None:
        ev = self._opened.get(handle)
        if ev is None:
            ev = self._opened[handle] = torch.cuda.Event.from_ipc_handle(self.device, handle)
            if len(self._opened) > self.limit:
                self._opened.popitem(last=False)
        torch.cuda.current_stream(self.device).wait_event(ev)
