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
from dataclasses import dataclass, field

from shared.engine.kv.allocator import OutOfCapacity
from shared.engine.kv.cache import KVCache
from shared.engine.kv.page_sums import PageSums
from shared.engine.kv.page_table import PageTable
from shared.engine.kv.prefix_index import PrefixIndex, Snapshot
from shared.engine.kv.snapshot import pages_for_snapshot, restore_window, save_window
from shared.engine.kv.window import RequestWindow, free_windows, replay_start
from shared.engine.request import Request

__all__ = ["CACHE_OWNER", "Hit", "KVOwnership"]

CACHE_OWNER = 1 << 62  # the pool's owner id of the pages the prefix cache keeps


@dataclass
class Hit:
    """What a request reads from the prefix cache, and what it must do to use it."""

    pages: list[int] = field(default_factory=list)  # the cached pages it reads (leading)
    start: int = 0  # the first position it computes
    restore: Snapshot | None = None  # the window snapshot at `start` to copy into its rings
    replay_from: int | None = None  # else: recompute [replay_from, start) into its rings (bounded replay)
    snapshot_at: list[int] = field(default_factory=list)  # boundaries to snapshot its rings at


class KVOwnership:
    def __init__(
        self, cache: KVCache, max_pages: int, prefix: PrefixIndex | None = None, replay_budget: int = 0
    ) -> None:
        self.cache = cache
        self.prefix = prefix  # the prefix cache's index; None: every request computes its whole prompt
        self.replay_budget = replay_budget  # the longest bounded replay a hit may cost (tokens)
        self.sums = PageSums(cache)  # prefix.pages_intact
        # Counters for the metrics: prompt tokens looked up, found (not computed), and pages evicted.
        self.queried_tokens = self.hit_tokens = self.evicted_pages = 0
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

    def allocate(self, req: Request, share: bool = False, *, computes: bool = True) -> bool:
        """A window slot and pages for prompt + max_tokens, all or nothing. `share`: the leading pages
        the prefix cache holds for the prompt are read from there (`req.num_computed` starts after
        them), and unreferenced cached pages are evicted when the pool is short. `computes`: the
        request computes its prompt here; False (a reservation whose KV another process sends whole,
        window included) shares every matching page, whatever the windows."""
        self.free_finished()  # capacity a completed step finished with is capacity
        need = self.cache.pages_needed(len(req.prompt) + req.params.max_tokens)
        hit = self._plan(req, computes) if share and self.prefix is not None else Hit()
        if hit.pages:
            self.prefix.acquire(hit.pages)  # type: ignore[union-attr]
        # Evicting may take the snapshot `hit.restore` itself: harmless, as its pages are read (below)
        # before any step that could write them is enqueued.
        if self.cache.slots.num_free == 0 or not self._room(need - len(hit.pages)):
            self._unplan(hit)
            return False
        try:
            req.window = RequestWindow(self.cache, req.rid)
            req.pages = hit.pages + self.cache.pages.alloc(req.rid, need - len(hit.pages))
        except OutOfCapacity:
            self.free(req)
            self._unplan(hit)
            return False
        req.shared = list(hit.pages)
        req.cached_tokens = req.num_computed = req.num_scheduled = hit.start
        if share and self.prefix is not None:
            self.queried_tokens += len(req.prompt)
            self.hit_tokens += hit.start
        req.snapshot_at, req.replay_from = hit.snapshot_at, hit.replay_from
        self.page_table.assign(req.window.slot, req.pages)
        self.sums.verify(hit.pages, req.window.slot)
        if hit.restore is not None:
            restore_window(self.cache, req.window.slot, hit.start, hit.restore.pages, hit.restore.payload)  # type: ignore[arg-type]
        return True

    def _unplan(self, hit: Hit) -> None:
        if hit.pages:
            self.prefix.release(hit.pages)  # type: ignore[union-attr]

    def _plan(self, req: Request, computes: bool) -> Hit:
        """Which cached pages `req` reads, and how its sliding layers get their window at the boundary
        (the cost model: docs/prefix-caching.md). The prompt's last token is always computed (its
        logits give the first output token)."""
        assert self.prefix is not None
        c, p = self.cache, self.cache.page_size
        pages = self.prefix.match(req.prompt[: len(req.prompt) - 1])
        if not c.sliding_layers or not computes:
            return Hit(pages, len(pages) * p)
        # Sliding layers: a boundary with a snapshot is read as it is; the deepest cached boundary
        # without one costs a bounded replay of what its rings need (only when it saves more and fits
        # one step's token budget), else the request computes from the snapshot (or from 0) and leaves
        # a snapshot at that boundary, where the next request with this prefix will stop too.
        deep, snap = len(pages), self.prefix.deepest_snapshot(pages)
        end = deep * p
        first = replay_start(end, self.cache.model.layer_types, c.window) if deep > snap else 0
        at: list[int] = []
        if deep > snap and first > snap * p and end - first <= self.replay_budget:
            hit = Hit(pages, end, replay_from=first)
        else:
            restore = self.prefix.snapshot(pages[snap - 1]) if snap else None
            hit = Hit(pages[:snap], snap * p, restore=restore)
            at = [end] if deep > snap else []
        last = len(req.prompt) // p * p  # the prompt's last whole page: where its next turn may stop
        if last > max(at, default=hit.start) and last > hit.start:
            at.append(last)
        hit.snapshot_at = at if pages_for_snapshot(c, p) else []
        return hit

    def _room(self, n: int) -> bool:
        """Whether `n` pages are free, evicting unreferenced cached pages to make them so."""
        short = n - self.cache.pages.num_free
        if short > 0 and self.prefix is not None and self.prefix.num_evictable >= short:
            evicted = self.prefix.evict(short)
            self.evicted_pages += len(evicted)
            self.cache.pages.free(CACHE_OWNER, evicted)
        return self.cache.pages.num_free >= n

    def drop_cached(self) -> None:
        """Evict every unreferenced cached page and every snapshot."""
        if self.prefix is not None:
            self.cache.pages.free(CACHE_OWNER, self.prefix.evict(self.prefix.num_evictable))

    def save_window(self, req: Request, boundary: int) -> None:
        """`req` has computed exactly `boundary` tokens (a step computing up to there is enqueued):
        snapshot its rings into pages of its own, cached with its prompt (`cache_prompt`). Skipped when
        the pool has no room for it."""
        n = pages_for_snapshot(self.cache, boundary)
        if req.window is None or not n or boundary in req.snapshots or not self._room(n):
            return
        pages = self.cache.pages.alloc(req.rid, n)
        req.snapshots[boundary] = (pages, save_window(self.cache, req.window.slot, boundary, pages))

    def cache_prompt(self, req: Request) -> None:
        """`req`'s prompt is computed: its full pages join the prefix cache (kept by it from now on,
        referenced by `req` until it ends), and its window snapshots with them."""
        if self.prefix is None or req.window is None:
            return
        added = self.prefix.insert(req.prompt, req.pages)
        if added:
            self.cache.pages.transfer(req.rid, CACHE_OWNER, added)
            req.shared += added
            self.sums.record(added)
        snapshots, req.snapshots = req.snapshots, {}
        for boundary, (pages, positions) in snapshots.items():
            if self.prefix.attach(req.prompt[:boundary], Snapshot(pages, positions)):
                self.cache.pages.transfer(req.rid, CACHE_OWNER, pages)
            else:  # its prefix was evicted meanwhile, or another request left one there first
                self.cache.pages.free(req.rid, pages)

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
        owned = []
        for r in reqs:
            shared = set(r.shared)
            if self.prefix is not None:
                self.prefix.release(r.shared)
            snapshot_pages = [p for pages, _ in r.snapshots.values() for p in pages]
            owned.append((r.rid, [p for p in r.pages if p not in shared] + snapshot_pages))
        self.cache.pages.free_many(owned)
        free_windows(self.cache, windows)
        for r in reqs:
            r.pages, r.window, r.shared, r.snapshots = [], None, [], {}

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
