"""The `inline` backend: KV as raw bytes in the control-plane stream. CPU and anywhere; one copy out
of the prefill cache (on its scheduler thread) and one into the decode cache (on decode's).

Full-attention layers ship the prompt's tokens [0, L) (gathered through the request's pages); sliding
layers ship only the last min(L, W) positions of their ring, so window bytes do not grow with the
prompt. Both halves run on the thread that owns their engine: the caches are not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from shared.kv.cache import KVCache
from shared.transfer.base import Chunk

__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "apply_chunk", "begin_receive", "extract_chunks"]

MAX_CHUNK_BYTES = (1 << 20) - 4096  # k + v of one message; the rest of 1 MiB is framing headroom
DEFAULT_CHUNK_BYTES = 512 * 1024


def _to_bytes(t: torch.Tensor) -> bytes:
    # Through uint8, not numpy's dtype: bfloat16 has no numpy equivalent.
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(b: bytes, like: torch.Tensor, count: int) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(b), dtype=torch.uint8)  # bytearray: frombuffer wants writable
    return flat.view(like.dtype).view(count, *like.shape[1:]).to(like.device)


def _flat_index(pages: list[int], page_size: int, start: int, count: int) -> torch.Tensor:
    pos = torch.arange(start, start + count)
    page = torch.tensor(pages, dtype=torch.long)[pos // page_size]
    return page * page_size + pos % page_size


def extract_chunks(
    cache: KVCache, pages: list[int], slot: int, num_tokens: int, *, window: bool = True,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[Chunk]:  # fmt: skip
    """The KV of a finished prompt of `num_tokens` tokens held in `pages` and window `slot`.

    Each chunk's k + v stays within `max_chunk_bytes` (capped at MAX_CHUNK_BYTES; at least one token).
    `window=False` leaves the sliding layers out (the receiver rebuilds them by bounded replay).
    """
    limit = min(max_chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
    m = cache.model
    per_token = 2 * m.num_kv_heads * m.head_dim * cache.k_pages.element_size()
    step = max(1, limit // per_token)
    for layer in cache.full_layers:
        i = cache.kind_index[layer]
        for start in range(0, num_tokens, step):
            n = min(step, num_tokens - start)
            idx = _flat_index(pages, cache.page_size, start, n).to(cache.device)
            k, v = cache.k_pages_flat[i][idx], cache.v_pages_flat[i][idx]
            yield Chunk(layer, False, start, n, _to_bytes(k), _to_bytes(v))
    if not window:
        return
    w = cache.window
    first = max(0, num_tokens - w)
    for layer in cache.sliding_layers:
        i = cache.kind_index[layer]
        for start in range(first, num_tokens, step):
            n = min(step, num_tokens - start)
            idx = (torch.arange(start, start + n) % w).to(cache.device)
            k, v = cache.k_ring[i, slot][idx], cache.v_ring[i, slot][idx]
            yield Chunk(layer, True, start, n, _to_bytes(k), _to_bytes(v))


def begin_receive(cache: KVCache, slot: int) -> None:
    """Empty the window slot's rings, so positions the sender has no history for read as absent."""
    cache.ring_pos[:, slot].fill_(-1)


def apply_chunk(cache: KVCache, pages: list[int], slot: int, chunk: Chunk) -> None:
    """Write one chunk into reserved `pages` / window `slot` (and set ring_pos for window chunks)."""
    if chunk.layer >= cache.model.num_layers or cache.is_sliding(chunk.layer) != chunk.window:
        raise ValueError(f"chunk for layer {chunk.layer} (window={chunk.window}) does not fit this cache")
    i, n = cache.kind_index[chunk.layer], chunk.token_count
    if chunk.window:
        w = cache.window
        pos = torch.arange(chunk.token_start, chunk.token_start + n)
        idx = (pos % w).to(cache.device)
        cache.k_ring[i, slot][idx] = _from_bytes(chunk.k, cache.k_ring[i, slot], n)
        cache.v_ring[i, slot][idx] = _from_bytes(chunk.v, cache.v_ring[i, slot], n)
        cache.ring_pos[i, slot][idx] = pos.to(device=cache.device, dtype=cache.ring_pos.dtype)
        return
    if chunk.token_start + n > len(pages) * cache.page_size:
        raise ValueError(f"chunk tokens [{chunk.token_start}, {chunk.token_start + n}) exceed the pages")
    idx = _flat_index(pages, cache.page_size, chunk.token_start, n).to(cache.device)
    cache.k_pages_flat[i][idx] = _from_bytes(chunk.k, cache.k_pages_flat[i], n)
    cache.v_pages_flat[i][idx] = _from_bytes(chunk.v, cache.v_pages_flat[i], n)
