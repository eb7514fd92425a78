"""The batch shapes every attention test walks through (sequence specs are (L0, chunk length))."""

from __future__ import annotations

# Chosen around W = 8 and page sizes 4 and 16: contexts of W-1, W, W+1, chunks that start at 0 and
# mid-sequence, chunks longer than the window, and page-boundary positions (3/4/5, 15/16/17).
SPECS: dict[str, list[tuple[int, int]]] = {
    "prefill-from-0": [(0, 7), (0, 8), (0, 9)],
    "prefill-mid": [(7, 6), (20, 11)],
    "long-chunk": [(3, 21)],
    "decode-around-W": [(6, 1), (7, 1), (8, 1), (0, 1)],
    "decode-pages": [(3, 1), (4, 1), (15, 1), (16, 1), (33, 1)],
    "mixed": [(0, 9), (12, 1), (5, 7), (40, 1)],
}

# (hq, hkv, d, page_size): GQA, MHA, a group of 3 with an odd head dim, MQA.
LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "gqa2-p4": (4, 2, 16, 4),
    "mha-p16": (2, 2, 32, 16),
    "gqa3-d24-p4": (6, 2, 24, 4),
    "mqa8-p16": (8, 1, 16, 16),
}

# None = full attention; 1 = only itself; 5 < most contexts; 8 = W; 64 > every context.
WINDOWS: list[int | None] = [None, 1, 5, 8, 64]
