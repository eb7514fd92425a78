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
from shared.engine.kv.prefix_index import PrefixIndex
from shared.engine.kv.window import RequestWindow, free_windows
from shared.engine.request import Request

__all__ = ["CACHE_OWNER", "KVOwnership"]

CACHE_OWNER = 1 << 62  # the pool's owner id of the pages the prefix cache keeps


class KVOwnership:
    def __init__(self, cache: KVCache, max_pages: int, prefix: PrefixIndex | None = None) -> None:
        self.cache = cache
        self.prefix = prefix  # the prefix cache's index; None: every request computes its whole prompt
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

    def allocate(self, req: Request, share: bool = False) -> bool:
        """A window slot and pages for prompt + max_tokens, all or nothing. `share`: the leading pages
        the prefix cache holds for the prompt are read from there (`req.num_computed` starts after
        them), and unreferenced cached pages are evicted when the pool is short."""
        self.free_finished()  # capacity a completed step finished with is capacity
        need = self.cache.pages_needed(len(req.prompt) + req.params.max_tokens)
        hits = self._hits(req) if share else []
        if self.cache.slots.num_free == 0 or not self._room(need - len(hits)):
            if hits:
                self.prefix.release(hits)  # type: ignore[union-attr]
            return False
        try:
            req.window = RequestWindow(self.cache, req.rid)
            req.pages = hits + self.cache.pages.alloc(req.rid, need - len(hits))
        except OutOfCapacity:
            self.free(req)
            if hits:
                self.prefix.release(hits)  # type: ignore[union-attr]
            return False
        req.shared_pages = len(hits)
        req.cached_tokens = req.num_computed = req.num_scheduled = len(hits) * self.cache.page_size
        self.page_table.assign(req.window.slot, req.pages)
        return True

    def _hits(self, req: Request) -> list[int]:
        """The cached pages of the prompt's prefix, referenced for `req`; the prompt's last token is
        always computed (its logits give the first output token)."""
        assert self.prefix is not None
        hits = self.prefix.match(req.prompt[: len(req.prompt) - 1])
        self.prefix.acquire(hits)
        return hits

    def _room(self, n: int) -> bool:
        """Whether `n` pages are free, evicting unreferenced cached pages to make them so."""
        short = n - self.cache.pages.num_free
        if short > 0 and self.prefix is not None and self.prefix.num_evictable >= short:
            self.cache.pages.free(CACHE_OWNER, self.prefix.evict(short))
        return self.cache.pages.num_free >= n

    def drop_cached(self) -> None:
        """Evict every unreferenced cached page."""
        if self.prefix is not None:
            self.cache.pages.free(CACHE_OWNER, self.prefix.evict(self.prefix.num_evictable))

    def cache_prompt(self, req: Request) -> None:
        """`req`'s prompt is computed: its full pages join the prefix cache (kept by it from now on,
        referenced by `req` until it ends)."""
        if self.prefix is None or req.window is None:
            return
        added = self.prefix.insert(req.prompt, req.pages)
        if added:
            self.cache.pages.transfer(req.rid, CACHE_OWNER, added)
            req.shared_pages += len(added)

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
        if self.prefix is not None:
            for r in reqs:
                self.prefix.release(r.pages[: r.shared_pages])
        self.cache.pages.free_many([(r.rid, r.pages[r.shared_pages :]) for r in reqs])
        free_windows(self.cache, windows)
        for r in reqs:
            r.pages, r.window, r.shared_pages = [], None, 0

    def check_integrity(self, idle: bool) -> None:
        """Pool conservation: the pools are consistent, and with nothing running every page and slot
        is free."""
        self.cache.pages.check_integrity()
        self.cache.slots.check_integrity()
        cached = 0
        if self.prefix is not None:
            self.prefix.check_integrity(self.cache.pages.free_units())
            cached = len(self.prefix)
            if idle and self.prefix.num_evictable != cached:
                held = cached - self.prefix.num_evictable
                raise AssertionError(f"idle engine: {held} cached pages still referenced")
        used = self.cache.pages.num_used - cached  # idle: free + cached = total
        if idle and (used or self.cache.slots.num_used):
            raise AssertionError(f"idle engine holds {used} pages and {self.cache.slots.num_used} slots")
