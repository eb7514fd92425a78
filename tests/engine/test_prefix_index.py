"""The prefix cache's index (shared/engine/kv/prefix_index.py): whole pages of a token prefix, found by
a hash chain, shared with reference counts, evicted least recently used and leaves first."""

from __future__ import annotations

import pytest

from shared.engine.kv.prefix_index import PrefixIndex, PrefixIndexError

P = 4  # tokens per page


def cached(tokens: list[int], pages: list[int], index: PrefixIndex) -> PrefixIndex:
    index.insert(tokens, pages)
    index.release(pages[: len(tokens) // P])
    return index


def test_a_prompt_matches_the_whole_pages_of_its_longest_cached_prefix() -> None:
    index = cached(
        list(range(10)), [7, 3, 9], PrefixIndex(P)
    )  # two full pages; the partial one is not cached
    assert len(index) == 2
    assert index.match(list(range(12))) == [7, 3]
    assert index.match([0, 1, 2, 3, 4, 5, 6, 99]) == [7]  # differs inside the second page
    assert index.match([0, 1, 2]) == []  # no whole page
    assert index.match([4, 5, 6, 7]) == []  # the same tokens at another offset are another prefix


def test_a_referenced_page_is_never_evicted_and_references_never_go_negative() -> None:
    index = cached(list(range(8)), [0, 1], PrefixIndex(P))
    index.acquire([0, 1])
    assert index.evict(2) == []
    index.release([0, 1])
    with pytest.raises(PrefixIndexError, match="released more often"):
        index.release([0])
    assert sorted(index.evict(2)) == [0, 1]
    index.check_integrity()


def test_eviction_takes_the_least_recently_used_leaves_before_their_parents() -> None:
    index = PrefixIndex(P)
    cached([1] * 8, [10, 11], index)  # used first
    cached([2] * 8, [20, 21], index)
    index.acquire(index.match([1] * 8))  # the first prefix used again: now the most recent
    index.release([10, 11])
    assert index.evict(1) == [21]  # the older prefix's leaf
    assert index.evict(1) == [20]  # then its root, never before its leaf
    assert index.match([1] * 8) == [10, 11]
    index.check_integrity()


def test_a_prefix_two_requests_computed_stays_cached_once() -> None:
    index = PrefixIndex(P)
    assert index.insert(list(range(8)), [0, 1]) == [0, 1]
    assert index.insert(list(range(8)), [5, 6]) == []  # the second copy stays the request's own
    index.release([0, 1])
    assert index.match(list(range(8))) == [0, 1] and not index.is_cached(5)
    index.check_integrity()


def test_the_integrity_check_finds_a_page_both_free_and_cached() -> None:
    index = cached(list(range(4)), [3], PrefixIndex(P))
    index.check_integrity(free_pages=[0, 1, 2])
    with pytest.raises(PrefixIndexError, match="both free and cached"):
        index.check_integrity(free_pages=[2, 3])
