"""KV ownership: the one place a request's pages and window slot are allocated and freed.

    colocated:     admit allocates                 -> finish frees
    prefill side:  add_request(hold_kv=True)       -> finish holds -> transfer reads -> release frees
    decode side:   reserve allocates -> transfer writes -> admit_prefilled (or release frees)
                   -> finish frees; rebuild_window when the sliding-window history did not arrive

`KVOwnership` holds the state of that: the page table every decode batch gathers from, the requests
held for a transfer (in or out), and the frees a step's completion defers. The Engine decides *when*
a free is safe (never under a step in flight that may still write the request's KV: it waits in
that step's `releases`); this object does the freeing, in one pass over the page table, the pools
and the rings for everything freed together. What a completion frees is given back once step() has
returned that step's tokens (`free_finished`): a batch finishing together frees thousands of pages,
and its last tokens need not wait for that.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shared.engine.kv.allocator import OutOfCapacity
from shared.engine.kv.cache import KVCache
from shared.engine.kv.page_table import PageTable
from shared.engine.kv.window import RequestWindow, free_windows
from shared.engine.request import Request

__all__ = ["KVOwnership"]


class KVOwnership:
    def __init__(self, cache: KVCache, max_pages: int) -> None:
        self.cache = cache
        # Every slot's pages, for decode batches (+ the scratch slot's empty row).
        self.page_table = PageTable(cache.cfg.max_requests + 1, max_pages)
        # Reserved for a transfer in, or finished but held for a transfer out.
        self.held: set[Request] = set()
        self._collecting: list[Request] | None = None  # frees during a step's completion
        self._finished: list[Request] = []  # what completions freed, once step() returned their tokens

    @property
    def owes(self) -> bool:
        """Some freed request's KV has not been given back yet (`free_finished`)."""
        return bool(self._finished)

    def allocate(self, req: Request) -> bool:
        """A window slot and pages for prompt + max_tokens, all or nothing."""
        self.free_finished()  # capacity a completed step finished with is capacity
        need = self.cache.pages_needed(len(req.prompt) + req.params.max_tokens)
        if self.cache.slots.num_free == 0 or self.cache.pages.num_free < need:
            return False
        try:
            req.window = RequestWindow(self.cache, req.rid)
            req.pages = self.cache.pages.alloc(req.rid, need)
        except OutOfCapacity:
            self.free(req)
            return False
        self.page_table.assign(req.window.slot, req.pages)
        return True

    @contextmanager
    def completing(self) -> Iterator[None]:
        """A step's completion: what it frees is given back after the caller has its tokens (the next
        `free_finished`), all at once."""
        self._collecting = []
        try:
            yield
        finally:
            collected, self._collecting = self._collecting, None
            self._finished += collected

    def free(self, req: Request) -> None:
        """Give back what `req` owns: now, or with the rest of a completion's frees."""
        if self._collecting is not None:
            self._collecting.append(req)
        else:
            self.free_now([req])

    def free_finished(self) -> None:
        """Give back what the completed steps finished with."""
        reqs, self._finished = self._finished, []
        self.free_now(reqs)

    def free_now(self, reqs: list[Request]) -> None:
        """Give back what `reqs` own in one pass each over the page table, the pools and the rings."""
        if not reqs:
            return
        reqs = list(dict.fromkeys(reqs))  # a request is freed once, however often it was asked for
        windows = [r.window for r in reqs if r.window is not None]
        self.page_table.clear([w.slot for w in windows])
        self.cache.pages.free_many([(r.rid, r.pages) for r in reqs])
        free_windows(self.cache, windows)
        for r in reqs:
            r.pages, r.window = [], None

    def check_integrity(self, idle: bool) -> None:
        """Pool conservation: the pools are consistent, and with nothing running every page and slot
        is free."""
        self.cache.pages.check_integrity()
        self.cache.slots.check_integrity()
        if idle and (self.cache.pages.num_used or self.cache.slots.num_used):
            raise AssertionError(
                f"idle engine holds {self.cache.pages.num_used} pages and {self.cache.slots.num_used} slots"
            )
