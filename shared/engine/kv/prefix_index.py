"""Which full-attention KV pages hold which token prefixes: the index of the prefix cache.

A page-hash chain, as vLLM's automatic prefix caching, rather than a radix tree over tokens: KV lives in
whole pages, so a page is the unit of sharing and the chain's key for page i is hash(key of page i-1,
the page's tokens). A lookup walks the prompt's full pages and stops at the first miss; only full pages
are cached (a request keeps writing its last, partial page). The key chains the whole prefix, so equal
keys mean equal prefixes, not equal pages at different offsets.

A cached page is referenced by the running requests that read it (`acquire`/`release`); with no
reference it stays cached and evictable, least recently used first and leaves before their parents (a
parent evicted first would strand its descendants: unreachable, yet holding memory). The index holds
page ids only; the pool (shared/engine/kv/allocator.py) owns the memory, and the engine decides when a
page can be read or given back (never under a step in flight).

Models with sliding layers also need each sliding layer's last W tokens at the boundary a hit ends
on. Such a window snapshot hangs on the entry of the boundary's last page (`attach`): pages of the pool
that hold it (shared/engine/kv/snapshot.py writes and reads them) and a payload the caller keeps with
it. A snapshot is never referenced (restoring one is a copy the device runs in stream order), so it is
evictable whenever it exists; it goes, least recently used first, alone or with its page.

Host-side only: lookups, references and eviction never touch the device. The index's own state
(reference counts, the chain, what is both free and cached) is checked here, on the host, where it
lives: a release below zero raises at once, and `check_integrity` walks the rest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixIndex", "PrefixIndexError", "Snapshot"]

_ROOT = b"pdserve-prefix-v1"


class PrefixIndexError(RuntimeError):
    """A reference count below zero, a page cached twice, or a parent evicted before its child."""


@dataclass(eq=False)
class Snapshot:
    """A sliding-window snapshot at the end of an entry's page: the pool pages that hold it, and what
    the caller keeps with it (the ring positions it holds)."""

    pages: list[int]
    payload: object


@dataclass(eq=False)
class _Entry:
    key: bytes
    page: int
    parent: _Entry | None
    depth: int  # pages before it in the prefix
    refs: int = 0
    children: int = 0
    snapshot: Snapshot | None = None


class PrefixIndex:
    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._by_key: dict[bytes, _Entry] = {}
        self._by_page: dict[int, _Entry] = {}
        # What eviction takes next, least recently used first: ("page", p) for an unreferenced leaf (a
        # page whose prefix no cached page extends), ("snapshot", p) for the snapshot on page p's entry.
        # A parent joins once its last child is evicted, at the front: it was used no later than it.
        self._lru: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._num_snapshots = 0
        self._snapshot_pages = 0
        self._unreferenced = 0

    def __len__(self) -> int:
        """Pages the index holds: prefix pages and the pages of their snapshots."""
        return len(self._by_page) + self._snapshot_pages

    @property
    def num_prefix_pages(self) -> int:
        return len(self._by_page)

    @property
    def num_snapshots(self) -> int:
        return self._num_snapshots

    @property
    def num_evictable(self) -> int:
        """Pages eviction can give back now: unreferenced prefix pages and every snapshot's."""
        return self._unreferenced + self._snapshot_pages

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The chain keys of `tokens`' full pages: key i = blake2b(key i-1, page i's token ids)."""
        width = 4 * self.page_size  # bytes of one page's ids (< 2**32 each)
        raw = memoryview(array("I", tokens[: len(tokens) // self.page_size * self.page_size]).tobytes())
        out, parent = [], _ROOT
        for start in range(0, len(raw), width):
            parent = hashlib.blake2b(raw[start : start + width], digest_size=16, key=parent).digest()
            out.append(parent)
        return out

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The pages of the longest cached prefix of `tokens` (whole pages), in order. Not referenced:
        `acquire` them before relying on them."""
        pages = []
        for key in self.keys(tokens):
            entry = self._by_key.get(key)
            if entry is None:
                break
            pages.append(entry.page)
        return pages

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    def refs(self, page: int) -> int:
        return self._by_page[page].refs

    def acquire(self, pages: Sequence[int]) -> None:
        """A request reads these cached pages: they are not evictable until it releases them."""
        for p in pages:
            entry = self._by_page[p]
            if entry.refs == 0:
                self._unreferenced -= 1
                self._lru.pop(("page", p), None)
            entry.refs += 1

    def release(self, pages: Sequence[int]) -> None:
        """A request is done with these cached pages; unreferenced ones become evictable, the deepest
        first (so that a leaf goes before its parent when they were used last together)."""
        for p in reversed(pages):
            entry = self._by_page[p]
            if entry.refs <= 0:
                raise PrefixIndexError(f"page {p}: released more often than acquired")
            entry.refs -= 1
            if entry.refs == 0:
                self._unreferenced += 1
                if not entry.children:
                    self._lru[("page", p)] = None

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache a request's full pages for the prefix `tokens` (pages[i] holds tokens of page i). The
        pages already cached under the same keys stay (another request computed them first); returns
        the pages that became cached, which the index now references for the caller (release them when
        the request ends, as with `acquire`)."""
        keys = self.keys(tokens)
        added, parent = [], None
        for key, page in zip(keys, pages, strict=False):
            entry = self._by_key.get(key)
            if entry is None:
                if page in self._by_page:
                    raise PrefixIndexError(f"page {page} is cached already, under another prefix")
                depth = parent.depth + 1 if parent is not None else 0
                entry = _Entry(key, page, parent, depth, refs=1)
                if parent is not None:
                    parent.children += 1
                    self._lru.pop(("page", parent.page), None)  # no longer a leaf
                self._by_key[key] = entry
                self._by_page[page] = entry
                added.append(page)
            # else: cached already (this page, or a copy another request computed first, which the
            # request keeps as its own, uncached); the pages after it still chain on the cached one.
            parent = entry
        return added

    def deepest_snapshot(self, pages: Sequence[int]) -> int:
        """How many of `pages` (a `match`) lead to the deepest boundary with a snapshot; 0: none."""
        for k in range(len(pages), 0, -1):
            if self._by_page[pages[k - 1]].snapshot is not None:
                return k
        return 0

    def snapshot(self, page: int) -> Snapshot | None:
        """The snapshot at the end of `page`'s entry (marked used: the last to be evicted)."""
        snap = self._by_page[page].snapshot
        if snap is not None:
            self._lru.move_to_end(("snapshot", page))
        return snap

    def attach(self, tokens: Sequence[int], snapshot: Snapshot) -> bool:
        """Keep `snapshot` at the end of `tokens` (whole pages), on the entry of their last page. False
        (and nothing kept) when that prefix is not cached or already has one: the caller frees it."""
        keys = self.keys(tokens)
        entry = self._by_key.get(keys[-1]) if keys and len(tokens) % self.page_size == 0 else None
        if entry is None or entry.snapshot is not None:
            return False
        entry.snapshot = snapshot
        self._snapshot_pages += len(snapshot.pages)
        self._num_snapshots += 1
        self._lru[("snapshot", entry.page)] = None
        return True

    def evict(self, n: int) -> list[int]:
        """At least `n` pages' worth, when there is that much to evict: unreferenced prefix pages
        (leaves before their parents) and snapshots, least recently used first, removed from the index
        (the caller gives them back to the pool). A page takes its snapshot with it."""
        out: list[int] = []
        while len(out) < n and self._lru:
            kind, page = next(iter(self._lru))
            entry = self._by_page[page]
            if kind == "snapshot":
                out += self._drop_snapshot(entry)
                continue
            out += self._drop_snapshot(entry)
            del self._lru[(kind, page)]
            del self._by_page[page]
            del self._by_key[entry.key]
            self._unreferenced -= 1
            out.append(page)
            parent = entry.parent
            if parent is not None:
                parent.children -= 1
                if not parent.children and not parent.refs:
                    self._lru[("page", parent.page)] = None
                    self._lru.move_to_end(("page", parent.page), last=False)
        return out

    def _drop_snapshot(self, entry: _Entry) -> list[int]:
        snap, entry.snapshot = entry.snapshot, None
        if snap is None:
            return []
        del self._lru[("snapshot", entry.page)]
        self._snapshot_pages -= len(snap.pages)
        self._num_snapshots -= 1
        return list(snap.pages)

    def check_integrity(self, free_pages: Sequence[int] = ()) -> None:
        """Every cached page once, counts consistent, no cached page also on the pool's free list."""
        if len(self._by_key) != len(self._by_page):
            raise PrefixIndexError("the key and page maps disagree")
        children: dict[int, int] = {}
        for page, entry in self._by_page.items():
            if entry.refs < 0:
                raise PrefixIndexError(f"page {page}: {entry.refs} references")
            evictable = ("page", page) in self._lru
            if (entry.refs == 0 and entry.children == 0) != evictable:
                raise PrefixIndexError(
                    f"page {page}: {entry.refs} references, {entry.children} children, in the LRU {evictable}"
                )
            if (entry.snapshot is not None) != (("snapshot", page) in self._lru):
                raise PrefixIndexError(f"page {page}: its snapshot and the eviction order disagree")
            if entry.parent is not None:
                if entry.parent.page not in self._by_page:
                    raise PrefixIndexError(f"page {page}: its parent page {entry.parent.page} was evicted")
                children[entry.parent.page] = children.get(entry.parent.page, 0) + 1
        for page, entry in self._by_page.items():
            if entry.children != children.get(page, 0):
                raise PrefixIndexError(
                    f"page {page}: {entry.children} children counted, {children.get(page, 0)} found"
                )
        held = list(self._by_page)
        for entry in self._by_page.values():
            held += entry.snapshot.pages if entry.snapshot is not None else []
        if len(set(held)) != len(held):
            raise PrefixIndexError("a page is held twice (a prefix page, or a snapshot's)")
        if len(held) - len(self._by_page) != self._snapshot_pages:
            raise PrefixIndexError("the snapshot page count disagrees with the snapshots")
        if sum(1 for e in self._by_page.values() if e.refs == 0) != self._unreferenced:
            raise PrefixIndexError("the unreferenced page count disagrees with the references")
        both = set(free_pages) & set(held)
        if both:
            raise PrefixIndexError(f"page {min(both)} is both free and cached")
