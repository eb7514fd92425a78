"""PageTable: every window slot's KV pages in one host int32 table, kept as requests come and go.

A decode batch's block table is then one vectorized gather by slot instead of a Python list over
every page of every request, rebuilt each step. Rows change only when a request gets its pages
(admission, a reservation) or frees them; `version` counts those changes, so a builder that cached
a gather knows when to redo it. Host memory only: nothing here touches the device.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PageTable"]


class PageTable:
    def __init__(self, num_slots: int, width: int) -> None:
        """`num_slots` rows (the scratch slot included: its row stays all zeros, as padded graph rows
        read), `width` pages a row at most (the longest context served)."""
        if num_slots <= 0 or width <= 0:
            raise ValueError(f"PageTable needs positive sizes, got {num_slots} slots x {width} pages")
        self.table = np.zeros((num_slots, width), dtype=np.int32)
        self.num_pages = np.zeros(num_slots, dtype=np.int64)  # pages each slot's row holds
        self.version = 0

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def assign(self, slot: int, pages: list[int]) -> None:
        """Slot `slot` now owns `pages`, in sequence order (a request admitted, or grown)."""
        n = len(pages)
        if n > self.width:
            raise ValueError(f"{n} pages do not fit a page table row of {self.width}")
        row = self.table[slot]
        row[:n] = pages
        row[n:] = 0
        self.num_pages[slot] = n
        self.version += 1

    def clear(self, slots: list[int]) -> None:
        """`slots` own no pages any more (their requests freed them): one pass for a step's frees."""
        if slots:
            self.table[slots] = 0
            self.num_pages[slots] = 0
            self.version += 1

    def pages(self, slot: int) -> list[int]:
        """The pages the table holds for `slot` (tests compare them with the requests')."""
        return self.table[slot, : self.num_pages[slot]].tolist()
