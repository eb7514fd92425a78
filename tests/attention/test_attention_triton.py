"""The Triton kernels (interpreted on CPU, compiled on CUDA) against the naive attention of the tests."""

from __future__ import annotations

import pytest
import torch
from attn_testutil import assert_close, make_batch, naive_attention
from cases import LAYOUTS, SPECS, WINDOWS

from shared.kernels.attention.paged_attention import paged_attention
from shared.kernels.attention.ring_attention import ring_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", list(SPECS))
def test_paged_matches_naive(case: str, window: int | None, layout: str) -> None:
    hq, hkv, d, page_size = LAYOUTS[layout]
    b = make_batch(SPECS[case], hq=hq, hkv=hkv, d=d, page_size=page_size, window=window, device=DEVICE)
    out = paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=window)
    assert_close(out, naive_attention(b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", [w for w in WINDOWS if w is not None])
@pytest.mark.parametrize("case", list(SPECS))
def test_ring_matches_naive(case: str, window: int, layout: str) -> None:
    hq, hkv, d, page_size = LAYOUTS[layout]
    b = make_batch(SPECS[case], hq=hq, hkv=hkv, d=d, page_size=page_size, window=window, device=DEVICE)
    out = ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=window)
    assert_close(out, naive_attention(b))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", ["decode-pages", "mixed"])
def test_split_k_matches_naive(case: str, window: int | None, num_splits: int) -> None:
    """Flash-decoding: key ranges split over programs (some empty: splits > keys) and merged."""
    b = make_batch(SPECS[case], hq=8, hkv=2, page_size=4, window=window, device=DEVICE)
    out = paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=window, num_splits=num_splits)
    assert_close(out, naive_attention(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["prefill-mid", "mixed"])
def test_half_precision(case: str, dtype: torch.dtype) -> None:
    b = make_batch(SPECS[case], hq=6, hkv=2, window=None, dtype=dtype, device=DEVICE)
    out = paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=None)
    assert_close(out, naive_attention(b))
    b = make_batch(SPECS[case], hq=6, hkv=2, window=5, dtype=dtype, device=DEVICE)
    expected = naive_attention(b)
    assert_close(paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=5), expected)
    split = paged_attention(*b.paged_args(), max_q=b.max_q, scale=b.scale, window=5, num_splits=2)
    assert_close(split, expected)
    assert_close(ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=5), expected)


def test_max_q_larger_than_every_chunk() -> None:
    b = make_batch(SPECS["mixed"], window=5, device=DEVICE)
    expected = naive_attention(b)
    assert_close(paged_attention(*b.paged_args(), max_q=b.max_q + 20, scale=b.scale, window=5), expected)
    assert_close(ring_attention(*b.ring_args(), max_q=b.max_q + 20, scale=b.scale, window=5), expected)


def test_strided_inputs() -> None:
    """q/k/v sliced out of one fused projection (row stride > Hq * D) read correctly."""
    b = make_batch(SPECS["prefill-mid"], hq=4, hkv=2, d=16, window=5, device=DEVICE)
    t = b.q.shape[0]
    fused = torch.randn(t, (4 + 2 + 2) * 16, device=DEVICE)
    fused[:, :64] = b.q.reshape(t, 64)
    fused[:, 64:96] = b.k_new.reshape(t, 32)
    fused[:, 96:] = b.v_new.reshape(t, 32)
    q, k, v = fused.split([64, 32, 32], dim=1)
    q, k, v = q.view(t, 4, 16), k.view(t, 2, 16), v.view(t, 2, 16)
    assert q.stride(0) == 128
    expected = naive_attention(b)
    ring = ring_attention(
        q, k, v, b.k_ring, b.v_ring, b.slots, b.cu_q, b.q_start, max_q=b.max_q, scale=b.scale, window=5
    )
    assert_close(ring, expected)
    paged = paged_attention(q, b.k_cache, b.v_cache, b.block_table, b.cu_q, b.q_start, max_q=b.max_q,
                            scale=b.scale, window=5)  # fmt: skip
    assert_close(paged, expected)
