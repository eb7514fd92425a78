"""Window snapshots: a request's sliding-layer rings at a page boundary, kept in pages of the KV pool.

A prefix hit that ends at boundary b reuses the full layers' pages of [0, b); a sliding layer also needs
its last W tokens of K/V at b, which only a ring holds, and a ring moves on. A snapshot is a copy of a
slot's rings taken when its request has computed exactly b tokens (the scheduler ends a chunk there):
every sliding layer's first R = min(b, W) ring rows (all of them once b >= W) and their positions. A
later request that hits at b copies it back into its own slot and computes from b.

The rows live in pages of the pool, so the prefix cache's memory stays bounded by the pool and one
LRU evicts prefix pages and snapshots alike: the pool's K (and V) storage is read as token rows, and
the snapshot's S*R rows fill page cells (one page of one full layer: P rows) in order, page by page
across the full layers. Its ring positions stay with it as a small device tensor ([S, R] int32), so a
restore puts back exactly what was saved, and `prefix.window_restored` checks they are the boundary's.

Every copy is enqueued on the device's stream in order with the steps: nothing here waits for it.
"""

from __future__ import annotations

import torch

from invariants import enabled, expect, predicates
from shared.engine.host_copy import to_device
from shared.engine.kv.cache import KVCache
from shared.engine.kv.invariants import PREFIX_WINDOW_RESTORED
from shared.kernels.kv_quant import as_bytes

__all__ = ["pages_for_snapshot", "restore_window", "save_window"]


def _rows(cache: KVCache, boundary: int) -> int:
    return min(boundary, cache.window)


def pages_for_snapshot(cache: KVCache, boundary: int) -> int:
    """Pool pages a snapshot at `boundary` takes (0 for a model without sliding or without full layers)."""
    if not cache.sliding_layers or not cache.full_layers or boundary <= 0:
        return 0
    cells = -(-len(cache.sliding_layers) * _rows(cache, boundary) // cache.page_size)
    return -(-cells // len(cache.full_layers))


def _index(cache: KVCache, boundary: int, pages: list[int]) -> torch.Tensor:
    """The pool's flat token-row index of each snapshot row (layer-major), on the device."""
    p, n_full = cache.page_size, len(cache.full_layers)
    r = torch.arange(len(cache.sliding_layers) * _rows(cache, boundary), dtype=torch.int64)
    cell = r // p
    page = torch.tensor(pages, dtype=torch.int64)[cell // n_full]
    return to_device(((cell % n_full) * cache.cfg.num_pages + page) * p + r % p, cache.device)


def _pool_rows(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V storage as token rows; an FP8 pool's as bytes (`as_bytes`): a snapshot
    copies stored rows as they are, quantized or not."""
    h, d = cache.model.num_kv_heads, cache.model.head_dim
    return as_bytes(cache.k_pages).view(-1, h, d), as_bytes(cache.v_pages).view(-1, h, d)


def save_window(cache: KVCache, slot: int, boundary: int, pages: list[int]) -> torch.Tensor:
    """Copy `slot`'s rings (which hold exactly `boundary` tokens' history) into `pages`; returns the
    positions they hold, which `restore_window` needs."""
    r = _rows(cache, boundary)
    h, d = cache.model.num_kv_heads, cache.model.head_dim
    idx = _index(cache, boundary, pages)
    k_rows, v_rows = _pool_rows(cache)
    k_rows.index_copy_(0, idx, as_bytes(cache.k_ring)[:, slot, :r].reshape(-1, h, d))
    v_rows.index_copy_(0, idx, as_bytes(cache.v_ring)[:, slot, :r].reshape(-1, h, d))
    return cache.ring_pos[:, slot, :r].clone()


def restore_window(
    cache: KVCache, slot: int, boundary: int, pages: list[int], positions: torch.Tensor
) -> None:
    """Put a snapshot back into `slot`'s rings (the rest of each ring empty), and check through
    `prefix.window_restored` that every sliding layer now holds exactly the last W positions before
    `boundary`."""
    r = _rows(cache, boundary)
    s, h, d = len(cache.sliding_layers), cache.model.num_kv_heads, cache.model.head_dim
    idx = _index(cache, boundary, pages)
    k_rows, v_rows = _pool_rows(cache)
    as_bytes(cache.k_ring)[:, slot, :r] = k_rows.index_select(0, idx).view(s, r, h, d)
    as_bytes(cache.v_ring)[:, slot, :r] = v_rows.index_select(0, idx).view(s, r, h, d)
    cache.ring_pos[:, slot].fill_(-1)
    cache.ring_pos[:, slot, :r] = positions
    if not enabled(PREFIX_WINDOW_RESTORED):  # OFF: not even the check's two tiny uploads
        return
    slots = to_device(torch.full((1,), slot, dtype=torch.int32), cache.device)
    lens = to_device(torch.full((1,), boundary, dtype=torch.int32), cache.device)
    expect(
        PREFIX_WINDOW_RESTORED,
        lambda: predicates.window_positions(cache.ring_pos, lens, index=slots),
        rows=slots,
    )
