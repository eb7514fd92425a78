"""The `inline` backend: KV as raw bytes in the control-plane stream. CPU and anywhere. Prefill copies
a prompt's KV out of its cache once (on its scheduler thread); decode joins the chunks' bytes into
host batches where it reads the stream (`ChunkAssembler`) and copies each batch into its cache on its
scheduler thread (`apply_batch`).

Full-attention layers ship the prompt's tokens [full_from, L) (gathered through the request's pages):
`full_from` is where the receiver's own prefix cache stops (PrefillRequest.cached_tokens; 0 without a
hit), and the receiver refuses any full-layer chunk before it, since its pages there are shared ones
other requests read. Sliding layers ship only the last min(L, W) positions of their ring, so window
bytes do not grow with the prompt. Both halves run on the thread that owns their engine: the caches are
not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from shared.engine.host_copy import to_device
from shared.engine.kv.cache import KVCache
from shared.kernels.kv_quant import as_bytes
from shared.model.config import SLIDING
from shared.transfer.base import Chunk, KVLayout

__all__ = [
    "DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "ChunkAssembler", "HeldPositions", "KVBatch", "StagedKV",
    "apply_batch", "apply_chunk", "begin_receive", "extract_chunks", "stage",
]  # fmt: skip

MAX_CHUNK_BYTES = (1 << 20) - 4096  # k + v of one message; the rest of 1 MiB is framing headroom
# As large as allowed: the cost per message (protobuf, gRPC, a scheduler wake-up) is most of the cost.
DEFAULT_CHUNK_BYTES = MAX_CHUNK_BYTES


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

    full: tuple[torch.Tensor, torch.Tensor] | None  # K, V [n_full, L - full_from, Hkv, D] on the host
    window: tuple[torch.Tensor, torch.Tensor] | None  # K, V [n_sliding, min(L, W), Hkv, D]
    full_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    first_window_pos: int
    event: torch.cuda.Event | None
    full_from: int = 0  # the first position of `full` (the receiver holds the ones before)

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
            (self.full, self.full_layers, self.full_from, False),
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


def stage(
    cache: KVCache, pages: list[int], slot: int, num_tokens: int, *, window: bool = True, full_from: int = 0
) -> StagedKV:
    """Gather a prompt of `num_tokens` tokens held in `pages` and window `slot`, and start its copy out.

    Full-attention layers: tokens [full_from, L) (the receiver holds the ones before). Sliding layers
    (`window`): the last min(L, W) positions of their rings. One gather per tensor and one
    device-to-host copy into pinned memory each: no host wait per chunk, and none at all on CUDA until
    the bytes are read.
    """
    if not 0 <= full_from < max(num_tokens, 1):
        raise ValueError(f"full_from {full_from} outside the prompt's {num_tokens} tokens")
    dev, m = cache.device, cache.model
    first = max(0, num_tokens - cache.window)
    full = win = None
    # An FP8 cache's rows are gathered as bytes (`as_bytes`): the chunks are bytes either way.
    if cache.full_layers:
        idx = to_device(_flat_index(pages, cache.page_size, full_from, num_tokens - full_from), dev)
        shape = (len(cache.full_layers), -1, m.num_kv_heads, m.head_dim)
        k_pages, v_pages = as_bytes(cache.k_pages), as_bytes(cache.v_pages)
        full = _download(k_pages.view(shape)[:, idx], v_pages.view(shape)[:, idx])
    if window and cache.sliding_layers:
        ring = to_device(torch.arange(first, num_tokens) % cache.window, dev)
        win = _download(as_bytes(cache.k_ring)[:, slot, ring], as_bytes(cache.v_ring)[:, slot, ring])
    event = None
    if dev.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
    return StagedKV(full, win, cache.full_layers, cache.sliding_layers, first, event, full_from)


def extract_chunks(
    cache: KVCache, pages: list[int], slot: int, num_tokens: int, *, window: bool = True,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, full_from: int = 0,
) -> Iterator[Chunk]:  # fmt: skip
    """`stage` and wait: the chunks of a finished prompt (tests and callers that may block).

    Each chunk's k + v stays within `max_chunk_bytes` (capped at MAX_CHUNK_BYTES; at least one token).
    `window=False` leaves the sliding layers out (the receiver rebuilds them by bounded replay).
    """
    staged = stage(cache, pages, slot, num_tokens, window=window, full_from=full_from)
    staged.wait()
    yield from staged.chunks(max_chunk_bytes)


@dataclass(frozen=True)
class KVBatch:
    """K and V [n, Hkv, D] of positions [token_start, token_start + n) of one layer, on the host (pinned
    when the receiver copies to a GPU): consecutive chunks, joined off the thread that applies them."""

    layer: int
    window: bool
    token_start: int
    k: torch.Tensor
    v: torch.Tensor

    @property
    def token_count(self) -> int:
        return self.k.shape[0]


class HeldPositions(ValueError):
    """A full-layer chunk for a position before `full_from`: the receiver holds those already, in shared
    pages it must never write (the sender did not ship from where it was asked to: an older one)."""


class ChunkAssembler:
    """The receiving end of one request's stream, on the thread that reads it (never the cache's).

    Checks every chunk against the layout and the prompt, and copies its bytes into a host buffer, so
    the thread owning the cache gets a few large `KVBatch`es per layer instead of one per chunk. Each
    layer's chunks must run contiguously from its first position (`full_from`, the end of the receiver's
    prefix-cache hit; a sliding layer's window start) to the prompt's end, each layer once, as the
    sender sends them: a gap, an overlap, a repeat or a layer left unfinished (`finish`) is an error,
    and a full-layer chunk before `full_from` is `HeldPositions`. Batches close at `max_batch_bytes` of
    K, bounding what one batch holds. A bad chunk raises ValueError, and the assembler stays unusable:
    the request fails, nothing of it is applied after the error.
    """

    def __init__(
        self, layout: KVLayout, num_tokens: int, *, window: bool, pin: bool = False,
        max_batch_bytes: int = 16 << 20, full_from: int = 0,
    ) -> None:  # fmt: skip
        self.dtype = getattr(torch, layout.dtype)
        self.row_shape = (layout.num_kv_heads, layout.head_dim)
        self.row_bytes = layout.num_kv_heads * layout.head_dim * self.dtype.itemsize
        self.sliding = tuple(t == SLIDING for t in layout.layer_types)
        self.num_tokens = num_tokens
        self.full_from = full_from  # full layers: positions before it are the receiver's (shared pages)
        self.first_window = max(0, num_tokens - layout.sliding_window)
        self.window = window  # the sliding layers' history is sent too
        self.pin = pin
        self.batch_rows = max(1, max_batch_bytes // self.row_bytes)
        self._next: dict[int, int] = {}  # layer -> the position its next chunk must start at
        self._open: tuple[int, bool, int, int, torch.Tensor, torch.Tensor] | None = None  # layer, window,
        # start, tokens so far, k and v buffers [capacity * row_bytes] uint8
        self._failed = False

    def add(
        self, layer: int, window: bool, token_start: int, token_count: int, k: bytes, v: bytes
    ) -> list[KVBatch]:
        """Take one chunk's fields; returns the batches it completes (usually none or one)."""
        return self._guarded(lambda: self._add(layer, window, token_start, token_count, k, v))

    def finish(self) -> list[KVBatch]:
        """The stream has ended: the batch still open; ValueError if a layer is incomplete."""
        return self._guarded(self._finish)

    def _guarded(self, fn: Callable[[], list[KVBatch]]) -> list[KVBatch]:
        if self._failed:
            raise ValueError("an earlier chunk of this request was bad")
        try:
            return fn()
        except ValueError:
            self._failed = True
            self._open = None
            raise

    def _first(self, layer: int) -> int:
        return self.first_window if self.sliding[layer] else self.full_from

    def _add(self, layer: int, window: bool, start: int, n: int, k: bytes, v: bytes) -> list[KVBatch]:
        if layer >= len(self.sliding) or self.sliding[layer] != window:
            raise ValueError(f"chunk for layer {layer} (window={window}) does not fit this cache")
        if window and not self.window:
            raise ValueError(f"chunk of window history for layer {layer}, which this request did not ask for")
        if not window and start < self.full_from:
            raise HeldPositions(
                f"full-layer chunk tokens [{start}, {start + n}) of layer {layer}: positions before "
                f"{self.full_from} are held here already (shared prefix-cache pages): the KV starts there"
            )
        want = self._next.get(layer, self._first(layer))
        if n < 1 or start != want or start + n > self.num_tokens:
            raise ValueError(
                f"chunk tokens [{start}, {start + n}) of layer {layer}: expected the next from {want} "
                f"on, within the prompt's {self.num_tokens} tokens (chunks of a layer run in order, once)"
            )
        if len(k) != n * self.row_bytes or len(v) != n * self.row_bytes:
            raise ValueError(
                f"chunk of {n} tokens carries {len(k)} + {len(v)} bytes, not 2 x {n * self.row_bytes}"
            )
        self._next[layer] = start + n
        out = []
        cur = self._open
        if cur is not None and (cur[0] != layer or cur[3] + n > cur[4].numel() // self.row_bytes):
            out.append(self._close())  # another layer, or no room: the batch so far goes as it is
            cur = None
        if cur is None:
            rows = max(n, min(self.num_tokens - start, self.batch_rows))
            kb, vb = (
                torch.empty(rows * self.row_bytes, dtype=torch.uint8, pin_memory=self.pin) for _ in "kv"
            )
            cur = (layer, window, start, 0, kb, vb)
        lo, hi = cur[3] * self.row_bytes, (cur[3] + n) * self.row_bytes
        cur[4][lo:hi].numpy()[:] = np.frombuffer(k, dtype=np.uint8)
        cur[5][lo:hi].numpy()[:] = np.frombuffer(v, dtype=np.uint8)
        self._open = (*cur[:3], cur[3] + n, *cur[4:])
        if cur[2] + cur[3] + n == self.num_tokens:
            out.append(self._close())
        return out

    def _finish(self) -> list[KVBatch]:
        layers = [i for i, sliding in enumerate(self.sliding) if self.window or not sliding]
        short = [
            i for i in layers if self._first(i) < self.num_tokens and self._next.get(i, -1) != self.num_tokens
        ]
        if short:
            raise ValueError(
                f"the stream ended with layers {short} short of the prompt's {self.num_tokens} tokens"
            )
        return [self._close()] if self._open is not None else []

    def _close(self) -> KVBatch:
        assert self._open is not None
        layer, window, start, n, kb, vb = self._open
        self._open = None
        size = n * self.row_bytes
        k, v = (b[:size].view(self.dtype).view(n, *self.row_shape) for b in (kb, vb))
        return KVBatch(layer, window, start, k, v)


def begin_receive(cache: KVCache, slot: int) -> None:
    """Empty the window slot's rings, so positions the sender has no history for read as absent."""
    cache.forget_windows([slot])


def apply_chunk(cache: KVCache, pages: list[int], slot: int, chunk: Chunk) -> None:
    """Write one chunk into reserved `pages` / window `slot` (and set ring_pos for window chunks)."""
    m = cache.model
    row = m.num_kv_heads * m.head_dim * cache.k_pages.element_size()
    n = chunk.token_count
    if len(chunk.k) != n * row or len(chunk.v) != n * row:
        raise ValueError(
            f"chunk of {n} tokens carries {len(chunk.k)} + {len(chunk.v)} bytes, not 2 x {n * row}"
        )
    k, v = (
        torch.frombuffer(bytearray(b), dtype=torch.uint8)
        .view(cache.k_pages.dtype)
        .view(n, m.num_kv_heads, m.head_dim)
        for b in (chunk.k, chunk.v)
    )  # bytearray: frombuffer wants a writable buffer
    apply_batch(cache, pages, slot, KVBatch(chunk.layer, chunk.window, chunk.token_start, k, v))


def apply_batch(cache: KVCache, pages: list[int], slot: int, batch: KVBatch, *, full_from: int = 0) -> None:
    """Write a batch into reserved `pages` / window `slot` (and set ring_pos for a window batch).

    `full_from`: the full layers' positions before it are in shared pages (the prefix cache's), never
    written: a batch there raises HeldPositions. Every upload goes through pinned memory: the decode
    scheduler thread applies batches while a step runs, and a copy from pageable memory would make it
    wait for that step."""
    if batch.layer >= cache.model.num_layers or cache.is_sliding(batch.layer) != batch.window:
        raise ValueError(f"chunk for layer {batch.layer} (window={batch.window}) does not fit this cache")
    i, n, start, dev = cache.kind_index[batch.layer], batch.token_count, batch.token_start, cache.device
    if batch.window and n > cache.window:
        raise ValueError(f"window chunk of {n} tokens exceeds the window {cache.window}")
    if not batch.window and start + n > len(pages) * cache.page_size:
        raise ValueError(f"chunk tokens [{start}, {start + n}) exceed the pages")
    if not batch.window and start < full_from:
        raise HeldPositions(f"chunk tokens [{start}, {start + n}) before {full_from}: shared pages")
    # An FP8 cache's rows go in as bytes (`as_bytes`: torch has no float8 index_copy_ on a CPU).
    k, v = as_bytes(to_device(batch.k, dev)), as_bytes(to_device(batch.v, dev))
    if batch.window:
        pos = torch.arange(start, start + n)
        idx = to_device(pos % cache.window, dev)
        as_bytes(cache.k_ring_l[i][slot]).index_copy_(0, idx, k)
        as_bytes(cache.v_ring_l[i][slot]).index_copy_(0, idx, v)
        cache.ring_pos_l[i][slot].index_copy_(0, idx, to_device(pos.to(cache.ring_pos.dtype), dev))
        return
    idx = to_device(_flat_index(pages, cache.page_size, start, n), dev)
    as_bytes(cache.k_pages_flat[i]).index_copy_(0, idx, k)
    as_bytes(cache.v_pages_flat[i]).index_copy_(0, idx, v)
