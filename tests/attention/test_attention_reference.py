"""reference.py (vectorized torch) against the naive per-query attention of the tests."""

from __future__ import annotations

import pytest
import torch
from attn_testutil import assert_close, make_batch, naive_attention
from cases import LAYOUTS, SPECS, WINDOWS

from shared.kernels.attention import reference


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", list(SPECS))
def test_paged_matches_naive(case: str, window: int | None, layout: str) -> None:
    hq, hkv, d, page_size = LAYOUTS[layout]
    b = make_batch(SPECS[case], hq=hq, hkv=hkv, d=d, page_size=page_size, window=window)
    out = reference.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=window)
    assert_close(out, naive_attention(b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", [w for w in WINDOWS if w is not None])
@pytest.mark.parametrize("case", list(SPECS))
def test_ring_matches_naive(case: str, window: int, layout: str) -> None:
    hq, hkv, d, page_size = LAYOUTS[layout]
    b = make_batch(SPECS[case], hq=hq, hkv=hkv, d=d, page_size=page_size, window=window)
    out = reference.ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=window)
    assert_close(out, naive_attention(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["prefill-mid", "mixed"])
def test_half_precision(case: str, dtype: torch.dtype) -> None:
    b = make_batch(SPECS[case], window=5, dtype=dtype)
    expected = naive_attention(b)
    assert_close(reference.paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=5), expected)
    assert_close(reference.ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=5), expected)


def test_max_q_larger_than_every_chunk() -> None:
    """max_q is an upper bound (a graph-sized batch may overstate it); extra grid rows change nothing."""
    b = make_batch(SPECS["mixed"], window=5)
    expected = naive_attention(b)
    out = reference.paged_attention(*b.paged_args(), max_q=b.max_q + 5, scale=b.scale, window=5)
    assert_close(out, expected)
    out = reference.ring_attention(*b.ring_args(), max_q=b.max_q + 5, scale=b.scale, window=5)
    assert_close(out, expected)


def test_ring_positions() -> None:
    pos = reference.ring_positions(torch.tensor([0, 3, 8, 11], dtype=torch.int32), 8)
    assert pos[0].tolist() == [-8, -7, -6, -5, -4, -3, -2, -1]  # empty ring: nothing valid
    assert pos[1].tolist() == [0, 1, 2, -5, -4, -3, -2, -1]
    assert pos[2].tolist() == list(range(8))
    assert pos[3].tolist() == [8, 9, 10, 3, 4, 5, 6, 7]
