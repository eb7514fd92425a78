"""Per-thread, per-device nesting of a `with` block whose outermost end acts on what the block noted:
`concurrent_checks` joins the side streams its checks forked onto, `batched_checks` launches the
checks it deferred."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

import torch

__all__ = ["Blocks"]

T = TypeVar("T")


class _State(threading.local, Generic[T]):
    def __init__(self) -> None:
        self.depth: dict[torch.device, int] = {}
        self.noted: dict[torch.device, list[T]] = {}


class Blocks(Generic[T]):
    """Depth per thread and device, and the items noted since the outermost block opened."""

    def __init__(self) -> None:
        self._state: _State[T] = _State()

    def depth(self, device: torch.device) -> int:
        """How many blocks for `device` this thread is inside."""
        return self._state.depth.get(device, 0)

    def enter(self, device: torch.device) -> None:
        d = self._state.depth
        d[device] = d.get(device, 0) + 1

    def note(self, device: torch.device, item: T) -> None:
        """`item` acted inside this thread's block for `device`: the outermost end returns it (once)."""
        noted = self._state.noted.setdefault(device, [])
        if item not in noted:
            noted.append(item)

    def leave(self, device: torch.device) -> list[T]:
        """Close one block. The outermost returns the noted items; an inner one, []."""
        d = self._state.depth
        left = d.get(device, 1) - 1
        if left > 0:
            d[device] = left
            return []
        d.pop(device, None)
        return self._state.noted.pop(device, [])
