"""The `inline` backend: KV as raw bytes in the control-plane stream. CPU and anywhere; one copy out
of the prefill cache (on its scheduler thread) and one into the decode cache (on decode's).

Full-attention layers ship the prompt's tokens [0, L) (gathered through the request's pages); sliding
layers ship only the last min(L, W) positions of their ring, so window bytes do not grow with the
prompt. Both halves run on the thread that owns their engine: the caches are not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shared.host_copy import to_device
from shared.kv.cache import KVCache
from shared.transfer.base import Chunk

__all__ = [
    "DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "StagedKV", "apply_chunk", "begin_receive", "extract_chunks",
    "stage",
]  # fmt: skip

MAX_CHUNK_BYTES = (1 << 20) - 4096  # k + v of one message; the rest of 1 MiB is framing headroom
DEFAULT_CHUNK_BYTES = 512 * 1024


def _from_bytes(b: bytes, like: torch.Tensor, count: int) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(b), dtype=torch.uint8)  # bytearray: frombuffer wants writable
    return to_device(flat.view(like.dtype).view(count, *like.shape[1:]), like.device)


def _flat_index(pages: list[int], page_size: int, start: int, count: int) -> torch.Tensor:
    pos = torch.arange(start, start + count)
    page = torch.tensor(pages, dtype=torch.long)[pos // page_size]
    return page * page_size + pos % page_size


@dataclass
class StagedKV:
    """A finished prompt's KV, gathered on the device and copied to host memory in one go.

    On CUDA the copy lands in pinned memory asynchronously: read the chunks once `ready()` (an event
    query, never a wait). The pages it came from can be freed as soon as it is made: the gather runs
    before any later work on the stream.
    """

    full: tuple[torch.Tensor, torch.Tensor] | None  # K, V [n_full, L, Hkv, D] on the host
    window: tuple[torch.Tensor, torch.Tensor] | None  # K, V [n_sliding, min(L, W), Hkv, D]
    full_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    first_window_pos: int
    event: torch.cuda.Event | None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block until the copy is done (`extract_chunks`: tests and callers that may block)."""
        if self.event is not None:
            self.event.synchronize()

    def nbytes(self) -> tuple[int, int]:
        """(full-layer bytes, window bytes): what `chunks` will carry, without building them."""
        size = lambda kv: 0 if kv is None else sum(t.numel() * t.element_size() for t in kv)
        return size(self.full), size(self.window)

    def chunks(self, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
        """The chunks, each k + v within `max_chunk_bytes` (capped at MAX_CHUNK_BYTES; >= one token).

        Lazy: each chunk's bytes are copied out of the host tensors when it is reached, so a sender
        streams a long prompt without holding a second copy of it (read once `ready()`)."""
        limit = min(max_chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        for kv, layers, first, window in (
            (self.full, self.full_layers, 0, False),
            (self.window, self.sliding_layers, self.first_window_pos, True),
        ):
            if kv is None:
                continue
            k_all, v_all = kv
            step = max(1, limit // (2 * k_all[0, 0].numel() * k_all.element_size()))
            for i, layer in enumerate(layers):
                for start in range(0, k_all.shape[1], step):
                    k, v = k_all[i, start : start + step], v_all[i, start : start + step]
                    yield Chunk(layer, window, first + start, k.shape[0], _bytes(k), _bytes(v))


def _bytes(t: torch.Tensor) -> bytes:
    # Through uint8, not numpy's dtype: bfloat16 has no numpy equivalent.
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _download(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not k.is_cuda:
        return k, v
    out = []
    for t in (k, v):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
    return out[0], out[1]


def stage(cache: KVCache, pages: list[int], slot: int, num_tokens: int, *, window: bool = True) -> StagedKV:
    """Gather a prompt of `num_tokens` tokens held in `pages` and window `slot`, and start its copy out.

    Full-attention layers: tokens [0, L). Sliding layers (`window`): the last min(L, W) positions of
    their rings. One gather per tensor and one device-to-host copy into pinned memory each: no host
    wait per chunk, and none at all on CUDA until the bytes are read.
    """
    dev, m = cache.device, cache.model
    first = max(0, num_tokens - cache.window)
    full = win = None
    if cache.full_layers:
        idx = to_device(_flat_index(pages, cache.page_size, 0, num_tokens), dev)
        shape = (len(cache.full_layers), -1, m.num_kv_heads, m.head_dim)
        full = _download(cache.k_pages.view(shape)[:, idx], cache.v_pages.view(shape)[:, idx])
    if window and cache.sliding_layers:
        ring = to_device(torch.arange(first, num_tokens) % cache.window, dev)
        win = _download(cache.k_ring[:, slot, ring], cache.v_ring[:, slot, ring])
    event = None
    if dev.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
    return StagedKV(full, win, cache.full_layers, cache.sliding_layers, first, event)


def extract_chunks(
    cache: KVCache, pages: list[int], slot: int, num_tokens: int, *, window: bool = True,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[Chunk]:  # fmt: skip
    """`stage` and wait: the chunks of a finished prompt (tests and callers that may block).

    Each chunk's k + v stays within `max_chunk_bytes` (capped at MAX_CHUNK_BYTES; at least one token).
    `window=False` leaves the sliding layers out (the receiver rebuilds them by bounded replay).
    """
    staged = stage(cache, pages, slot, num_tokens, window=window)
    staged.wait()
    yield from staged.chunks(max_chunk_bytes)


def begin_receive(cache: KVCache, slot: int) -> None:
    """Empty the window slot's rings, so positions the sender has no history for read as absent."""
    cache.ring_pos[:, slot].fill_(-1)


def apply_chunk(cache: KVCache, pages: list[int], slot: int, chunk: Chunk) -> None:
    """Write one chunk into reserved `pages` / window `slot` (and set ring_pos for window chunks).

    Every upload goes through pinned memory: the decode scheduler thread applies chunks while a step
    runs, and a copy from pageable memory would make it wait for that step."""
    if chunk.layer >= cache.model.num_layers or cache.is_sliding(chunk.layer) != chunk.window:
        raise ValueError(f"chunk for layer {chunk.layer} (window={chunk.window}) does not fit this cache")
    i, n = cache.kind_index[chunk.layer], chunk.token_count
    if chunk.window:
        w = cache.window
        pos = torch.arange(chunk.token_start, chunk.token_start + n)
        idx = to_device(pos % w, cache.device)
        cache.k_ring[i, slot][idx] = _from_bytes(chunk.k, cache.k_ring[i, slot], n)
        cache.v_ring[i, slot][idx] = _from_bytes(chunk.v, cache.v_ring[i, slot], n)
        cache.ring_pos[i, slot][idx] = to_device(pos.to(cache.ring_pos.dtype), cache.device)
        return
    if chunk.token_start + n > len(pages) * cache.page_size:
        raise ValueError(f"chunk tokens [{chunk.token_start}, {chunk.token_start + n}) exceed the pages")
    idx = to_device(_flat_index(pages, cache.page_size, chunk.token_start, n), cache.device)
    cache.k_pages_flat[i][idx] = _from_bytes(chunk.k, cache.k_pages_flat[i], n)
    cache.v_pages_flat[i][idx] = _from_bytes(chunk.v, cache.v_pages_flat[i], n)
