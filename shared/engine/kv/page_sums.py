"""`prefix.pages_intact`: the KV pages a prefix hit reads are bit for bit what was cached.

A cached page is written once, by the request that computed it, and only read afterwards; a bug that
frees a cached page while it is still indexed (or writes through a stale page id) would hand later
hits another request's KV, silently. When a page is cached its bits are summed on the device (K and V,
every full layer, as integers: exact, whatever the order); a hit sums its pages again and checks the two
agree, through the sync-free invariants API. At OFF nothing is summed or kept.
"""

from __future__ import annotations

import torch

from invariants import enabled, expect
from shared.engine.host_copy import to_device
from shared.engine.kv.cache import KVCache
from shared.engine.kv.invariants import PREFIX_PAGES_INTACT

__all__ = ["PageSums"]

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PageSums:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._sums: torch.Tensor | None = None  # [num_pages] int64, made on first use
        self._known: torch.Tensor | None = None  # [num_pages] bool: summed when cached

    def _of(self, idx: torch.Tensor) -> torch.Tensor:
        c = self.cache
        as_int = _AS_INT[c.k_pages.element_size()]
        total = torch.zeros(idx.shape[0], dtype=torch.int64, device=c.device)
        for pool in (c.k_pages, c.v_pages):
            bits = pool.view(as_int).index_select(1, idx)  # [n_full, n, P, Hkv, D]
            total += bits.sum(dim=(0, 2, 3, 4), dtype=torch.int64)
        return total

    def _index(self, pages: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(pages, dtype=torch.int64), self.cache.device)

    def record(self, pages: list[int]) -> None:
        """`pages` were just cached: remember their sums."""
        if not pages or not self.cache.full_layers or not enabled(PREFIX_PAGES_INTACT):
            return
        if self._sums is None or self._known is None:
            n, dev = self.cache.cfg.num_pages, self.cache.device
            self._sums = torch.zeros(n, dtype=torch.int64, device=dev)
            self._known = torch.zeros(n, dtype=torch.bool, device=dev)
        idx = self._index(pages)
        self._sums.index_copy_(0, idx, self._of(idx))
        self._known.index_fill_(0, idx, True)

    def verify(self, pages: list[int], slot: int) -> None:
        """A hit reads `pages` (for the request in window `slot`): check they still hold what was cached."""
        if not pages or self._sums is None or self._known is None or not enabled(PREFIX_PAGES_INTACT):
            return
        idx = self._index(pages)
        sums, known = self._sums, self._known
        rows = to_device(torch.full((len(pages),), slot, dtype=torch.int32), self.cache.device)

        def intact() -> torch.Tensor:  # a page cached while the check was off is not judged
            return (self._of(idx) == sums.index_select(0, idx)) | ~known.index_select(0, idx)

        expect(PREFIX_PAGES_INTACT, intact, rows=rows)
