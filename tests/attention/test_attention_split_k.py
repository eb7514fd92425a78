"""Split-K decode: the ring kernel's split over its filled entries, and the split rule both kernels use.

On CPU the kernels run in the interpreter with 16-key tiles, so rings of 24-40 entries span two or
three tiles and 16 splits is more splits than tiles (those splits read nothing and weigh nothing).
"""

from __future__ import annotations

import pytest
import torch
from attn_testutil import assert_close, make_batch, naive_attention
from cases import SPECS

from shared.kernels import _launch
from shared.kernels._launch import choose_splits, choose_tiles, interpreting, split_count
from shared.kernels.attention.paged_attention import paged_attention
from shared.kernels.attention.ring_attention import ring_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H200_SMS = 132

# (L0, n) around W = 24 and 40: empty rings, partly filled, exactly full, wrapped; contexts below and
# above the window.
RING_SPECS: dict[str, list[tuple[int, int]]] = {
    "decode": [(0, 1), (5, 1), (23, 1), (24, 1), (39, 1), (40, 1), (41, 1), (100, 1)],
    "short-chunks": [(0, 3), (17, 2), (38, 3), (60, 5), (100, 4), (24, 1)],
}


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])
@pytest.mark.parametrize("window", [8, 24, 40])
@pytest.mark.parametrize("case", list(RING_SPECS))
def test_ring_split_k_matches_naive(case: str, window: int, num_splits: int) -> None:
    b = make_batch(RING_SPECS[case], hq=4, hkv=2, d=16, window=window, device=DEVICE)
    out = ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=window, num_splits=num_splits)
    assert_close(out, naive_attention(b))


@pytest.mark.parametrize("case", ["long-chunk", "mixed", "prefill-mid"])
def test_ring_split_k_forced_on_long_chunks(case: str) -> None:
    """Forced splits stay correct when chunks span several query tiles (the rule never splits these)."""
    b = make_batch(SPECS[case], hq=6, hkv=2, d=24, window=5, device=DEVICE)
    out = ring_attention(*b.ring_args(), max_q=b.max_q, scale=b.scale, window=5, num_splits=3)
    assert_close(out, naive_attention(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ring_split_k_half_precision(dtype: torch.dtype) -> None:
    b = make_batch(RING_SPECS["decode"], hq=4, hkv=2, d=16, window=24, dtype=dtype, device=DEVICE)
    expected = naive_attention(b)
    for splits in (2, 4):
        out = ring_attention(*b.ring_args(), max_q=1, scale=b.scale, window=24, num_splits=splits)
        assert_close(out, expected)


def test_rule_at_the_engine_decode_shape() -> None:
    """Batch 64 x 8 kv heads = 512 programs fill 132 SMs at ~4 decode programs each: no split (the
    tuned 32-key tiles were fastest unsplit there). Batch 1 splits as far as its length allows."""
    bn = choose_tiles(2, 128, 1).block_n
    assert bn == 32 or interpreting()
    assert split_count(64 * 8, 1024, 32, H200_SMS) == 1  # ring, W = 1024
    assert split_count(64 * 8, 512 * 16, 32, H200_SMS) == 1  # paged, a graph-wide table (8192 keys)
    assert split_count(16 * 8, 1024, 32, H200_SMS) == 4  # batch 16: 128 programs, 4 splits reach 396
    assert split_count(8, 32768, 32, H200_SMS) == 32
    assert split_count(8, 1024, 32, H200_SMS) == 8  # eight splits of four 32-key tiles
    assert split_count(8, 300, 32, H200_SMS) == 2
    assert split_count(8, 200, 32, H200_SMS) == 1  # under two splits of four 32-key tiles


@pytest.mark.parametrize("sms", [16, 78, 132])
def test_rule_invariants(sms: int) -> None:
    for programs in (1, 3, 8, 64, 100, 256, 512, 513, 4096):
        for span in (1, 64, 255, 512, 528, 1024, 4097, 65536):
            for block_n in (32, 64):
                s = split_count(programs, span, block_n, sms)
                assert s >= 1 and s & (s - 1) == 0 and s <= _launch.MAX_SPLITS
                target = _launch.PROGRAMS_PER_SM * sms
                min_keys = _launch.MIN_TILES_PER_SPLIT * block_n
                if s > 1:  # every split keeps its minimum of tiles, and no split is spent past the target
                    assert span // s >= min_keys
                    assert programs * (s // 2) < target
                if programs * s < target and s < _launch.MAX_SPLITS:  # short of the target: length-bound
                    assert 2 * s > span // min_keys


def test_choose_splits_forced_and_gated() -> None:
    tiles = choose_tiles(2, 128, 1)
    cpu = torch.device("cpu")
    assert choose_splits("op", cpu, None, tiles, 1, 8, 1 << 15) == 1  # off CUDA the rule is never asked
    assert choose_splits("op", cpu, 5, tiles, 1, 8, 16) == 5  # forced: taken as given
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_splits must be a positive int"):
            choose_splits("op", cpu, bad, tiles, 1, 8, 1 << 15)  # type: ignore[arg-type]
    if torch.cuda.is_available():  # a chunk over several query tiles (prefill) never splits
        prefill = choose_tiles(2, 128, 512)
        assert prefill.q_blocks(512) > 1
        assert choose_splits("op", torch.device("cuda"), None, prefill, 512, 8, 1 << 15) == 1
        assert choose_splits("op", torch.device("cuda"), None, tiles, 1, 8, 1 << 15) > 1


@pytest.mark.parametrize("window", [None, 150])
def test_paged_decode_with_the_rule_matches_naive(window: int | None) -> None:
    """The split the rule picks for a few long sequences (as on an H200) gives the same results."""
    specs = [(300, 1), (129, 1), (64, 1)]
    b = make_batch(specs, hq=4, hkv=2, d=16, page_size=4, window=window, device=DEVICE)
    span = b.block_table.shape[1] * 4 if window is None else min(b.block_table.shape[1] * 4, window)
    splits = split_count(3 * 2, span, choose_tiles(2, 16, 1).block_n, H200_SMS)
    if interpreting():  # 16-key tiles: 308 keys allow 4 splits, a window of 150 allows 2
        assert splits == (4 if window is None else 2)
    expected = naive_attention(b)
    for s in (1, splits):
        out = paged_attention(*b.paged_args(), max_q=1, scale=b.scale, window=window, num_splits=s)
        assert_close(out, expected)


def test_ring_decode_with_the_rule_matches_naive() -> None:
    b = make_batch([(300, 1), (100, 1), (0, 1), (149, 1)], hq=4, hkv=2, d=16, window=150, device=DEVICE)
    splits = split_count(4 * 2, 150, choose_tiles(2, 16, 1).block_n, H200_SMS)
    if interpreting():
        assert splits == 2
    expected = naive_attention(b)
    for s in (1, splits):
        out = ring_attention(*b.ring_args(), max_q=1, scale=b.scale, window=150, num_splits=s)
        assert_close(out, expected)
