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

Host-side only: lookups, references and eviction never touch the device.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixIndex", "PrefixIndexError"]

_ROOT = b"pdserve-prefix-v1"


class PrefixIndexError(RuntimeError):
    """A reference count below zero, a page cached twice, or a parent evicted before its child."""


@dataclass(eq=False)
class _Entry:
    key: bytes
    page: int
    parent: _Entry | None
    depth: int  # pages before it in the prefix
    refs: int = 0
    children: int = 0


def _key(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(tokens).to_bytes(4, "little"))
    for t in tokens:
        h.update(int(t).to_bytes(4, "little"))
    return h.digest()


class PrefixIndex:
    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._by_key: dict[bytes, _Entry] = {}
        self._by_page: dict[int, _Entry] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced pages, LRU first

    def __len__(self) -> int:
        return len(self._by_page)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The chain keys of `tokens`' full pages."""
        out, parent = [], _ROOT
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            parent = _key(parent, tokens[start : start + self.page_size])
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
            entry.refs += 1
            self._evictable.pop(p, None)

    def release(self, pages: Sequence[int]) -> None:
        """A request is done with these cached pages; unreferenced ones become evictable, the deepest
        first (so that a leaf goes before its parent when they were used last together)."""
        for p in reversed(pages):
            entry = self._by_page[p]
            if entry.refs <= 0:
                raise PrefixIndexError(f"page {p}: released more often than acquired")
            entry.refs -= 1
            if entry.refs == 0:
                self._evictable[p] = None
                self._evictable.move_to_end(p)

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
                self._by_key[key] = entry
                self._by_page[page] = entry
                added.append(page)
            elif entry.page != page:
                break  # a copy of a cached page: the request keeps its own, uncached, from here on
            parent = entry
        return added

    def evict(self, n: int) -> list[int]:
        """Up to `n` unreferenced pages, least recently used leaves first, removed from the index (the
        caller gives them back to the pool)."""
        out: list[int] = []
        progress = True
        while len(out) < n and self._evictable and progress:
            progress = False
            for page in list(self._evictable):
                entry = self._by_page[page]
                if entry.children:
                    continue  # its children go first
                del self._evictable[page]
                del self._by_page[page]
                del self._by_key[entry.key]
                if entry.parent is not None:
                    entry.parent.children -= 1
                out.append(page)
                progress = True
                if len(out) == n:
                    break
        return out

    def check_integrity(self, free_pages: Sequence[int] = ()) -> None:
        """Every cached page once, counts consistent, no cached page also on the pool's free list."""
        if len(self._by_key) != len(self._by_page):
            raise PrefixIndexError("the key and page maps disagree")
        children: dict[int, int] = {}
        for page, entry in self._by_page.items():
            if entry.refs < 0:
                raise PrefixIndexError(f"page {page}: {entry.refs} references")
            if (entry.refs == 0) != (page in self._evictable):
                raise PrefixIndexError(
                    f"page {page}: {entry.refs} references, evictable {page in self._evictable}"
                )
            if entry.parent is not None:
                if entry.parent.page not in self._by_page:
                    raise PrefixIndexError(f"page {page}: its parent page {entry.parent.page} was evicted")
                children[entry.parent.page] = children.get(entry.parent.page, 0) + 1
        for page, entry in self._by_page.items():
            if entry.children != children.get(page, 0):
                raise PrefixIndexError(
                    f"page {page}: {entry.children} children counted, {children.get(page, 0)} found"
                )
        both = set(free_pages) & set(self._by_page)
        if both:
            raise PrefixIndexError(f"page {min(both)} is both free and cached")
