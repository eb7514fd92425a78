"""The `cuda_ipc` backend: prefill writes a request's KV straight into decode's reserved pages.

Same node only. Decode exports its pool once (`export_pool`: one CUDA IPC handle per pool tensor, and
its GPU's UUID, since device indices differ between processes) and sends that export with every
PrefillRequest: a prefill that restarted, or one of several behind round_robin, maps it on first sight
(`PeerPools`) with no handshake state to lose. Prefill maps the pool in its own GPU's context with lazy
peer access, so one Triton kernel on its GPU gathers its pages and stores them into decode's, over
NVLink when the two are on different GPUs (`push`).

Ordering is by interprocess CUDA events, never by the host: decode records one after it has readied the
reservation and prefill's stream waits on it before writing; prefill records one after writing and
decode's stream waits on it before the first step that reads the pages. Prefill's own pages can be
released as soon as the writes are enqueued: later work on its stream runs after them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.host_copy import to_device
from shared.engine.kv.cache import KVCache
from shared.kernels.copy_rows import copy_heads, copy_rows
from shared.pb.pdserve.v1 import cuda_ipc_pb2 as pb
from shared.transfer.ipc_events import EventRing, OpenedEvents
from shared.transfer.ipc_memory import (
    IpcUnavailable,
    PeerPool,
    PeerPools,
    PeerTensor,
    PoolExport,
    export_pool,
)

__all__ = [
    "EventRing", "HeadRun", "IpcReceiver", "IpcTarget", "IpcUnavailable", "IpcWriter", "OpenedEvents",
    "PeerPool", "PeerPools", "PoolExport", "export_pool", "push",
]  # fmt: skip


def _upload(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.int32), device)


def _by_row(t: torch.Tensor | PeerTensor, rows_from: int) -> tuple[int, ...]:
    """`t`'s shape as [layers, rows, row elements], the row being dims rows_from.. merged."""
    shape = t.shape
    return (shape[0], math.prod(shape[1:rows_from]), math.prod(shape[rows_from:]))


@dataclass(frozen=True)
class HeadRun:
    """A run of KV heads one rank writes into another's pool (tensor parallelism): `count` heads from
    this pool's head `src_first` into the destination's `dst_first` on, and with `ring_pos` the slot's
    ring_pos row (identical on every rank: one writer per destination)."""

    src_first: int
    dst_first: int
    count: int
    ring_pos: bool


def push(
    src: KVCache, pages: Sequence[int], slot: int, num_tokens: int, dst: PeerPool,
    dst_pages: Sequence[int], dst_slot: int, *, window: bool, full_from: int = 0,
    heads: HeadRun | None = None,
) -> tuple[int, int]:  # fmt: skip
    """Enqueue the writes of a prompt's KV into decode's reservation; (full bytes, window bytes).

    Full layers: the prompt's pages from position `full_from` on (a multiple of the page size: decode
    holds the ones before, shared), whole (a last page's tail past the prompt is decode's to overwrite
    before it reads it); `dst_pages[0]` is decode's page for position `full_from`. Sliding layers
    (`window`): the ring's filled part, which is its first min(num_tokens, W) entries (position p sits
    at index p % W), and the slot's whole ring_pos row, so positions without history read as absent.
    Three small index uploads; no other host work. `heads`: that run of KV heads only (each side's
    rows hold its own rank's share), and the ring_pos row only where the run says.
    """
    t = dst.tensors
    if full_from % src.page_size or not 0 <= full_from < max(num_tokens, 1):
        raise ValueError(f"full_from {full_from}: no page boundary within {num_tokens} tokens")
    skip = full_from // src.page_size
    need = src.pages_needed(num_tokens) - skip
    if len(dst_pages) < need or t["k_pages"].shape[2] != src.page_size:
        raise ValueError(f"{len(dst_pages)} destination pages of {t['k_pages'].shape[2]} cannot hold "
                         f"tokens [{full_from}, {num_tokens}) in pages of {src.page_size}")  # fmt: skip
    if any(not 0 <= p < t["k_pages"].shape[1] for p in dst_pages[:need]):
        raise ValueError("destination page outside decode's pool")
    if not 0 <= dst_slot < t["k_ring"].shape[1]:
        raise ValueError(f"destination slot {dst_slot} outside decode's pool")
    dev, full, window_bytes = src.device, 0, 0
    share = 1.0 if heads is None else heads.count / src.k_pages.shape[3]  # of a row's bytes
    if src.full_layers and need:
        s, d = _upload(pages[skip : skip + need], dev), _upload(dst_pages[:need], dev)
        for name in ("k_pages", "v_pages"):
            pool = getattr(src, name)
            if heads is None:
                copy_rows(pool.view(_by_row(pool, 2)), t[name], _by_row(t[name], 2), s, d)
            else:
                copy_heads(
                    pool, t[name], t[name].shape, s, d, (heads.src_first, heads.dst_first, heads.count)
                )
            full += int(pool[:, 0].numel() * share) * need * pool.element_size()
    if window and src.sliding_layers and num_tokens:
        s, d = _upload([slot], dev), _upload([dst_slot], dev)
        filled = min(num_tokens, src.window)
        for name in ("k_ring", "v_ring"):
            pool = getattr(src, name)
            per_entry = pool[0, 0, 0].numel()
            if heads is None:
                copy_rows(pool.view(_by_row(pool, 2)), t[name], _by_row(t[name], 2), s, d, filled * per_entry)
            else:
                run = (heads.src_first, heads.dst_first, heads.count)
                copy_heads(pool, t[name], t[name].shape, s, d, run, tokens=filled)
            window_bytes += pool.shape[0] * filled * int(per_entry * share) * pool.element_size()
        if heads is None or heads.ring_pos:
            copy_rows(src.ring_pos, t["ring_pos"], t["ring_pos"].shape, s, d)
    return full, window_bytes


@dataclass(frozen=True)
class IpcTarget:
    """Where one request's KV goes in decode's pool, and the events and lease that guard it."""

    pool: PoolExport
    pages: tuple[int, ...]  # decode's reserved pages from PrefillRequest.cached_tokens on
    slot: int
    ready_event: bytes  # recorded by decode once the reservation is ready; empty: nothing to wait on
    lease_deadline_ns: int  # unix epoch ns; no write may be launched after it

    def to_pb(self) -> pb.CudaIpcTarget:
        return pb.CudaIpcTarget(
            pool=self.pool.to_pb(), pages=list(self.pages), slot=self.slot, ready_event=self.ready_event,
            lease_deadline_unix_ns=self.lease_deadline_ns,
        )  # fmt: skip

    @classmethod
    def from_pb(cls, msg: pb.CudaIpcTarget) -> IpcTarget:
        pool = PoolExport.from_pb(msg.pool)
        return cls(pool, tuple(msg.pages), msg.slot, msg.ready_event, msg.lease_deadline_unix_ns)


class IpcWriter:
    """Prefill's half: the decode pools it has mapped, decode's events it has opened, its own events."""

    def __init__(self, cache: KVCache) -> None:
        if cache.device.type != "cuda":
            raise IpcUnavailable("cuda_ipc needs the KV cache on a CUDA device")
        self.cache = cache
        self._lock = threading.Lock()  # handshakes map on the event loop, writes run on the scheduler
        self._pools = PeerPools(cache.device, cache)
        self._opened = OpenedEvents(cache.device)
        self._ring = EventRing(cache.device)

    def map(self, export: PoolExport) -> None:
        """Map decode's pool now (a handshake), so an unreachable one fails before any request."""
        with self._lock:
            self._pools.get(export)

    def mapped(self, pool_id: str) -> bool:
        with self._lock:
            return pool_id in self._pools

    def write(
        self, pages: Sequence[int], slot: int, num_tokens: int, target: IpcTarget, *, window: bool,
        full_from: int = 0, writes: Sequence[tuple[PoolExport, HeadRun | None]] | None = None,
    ) -> tuple[int, int, bytes]:  # fmt: skip
        """Enqueue the request's KV writes after decode's ready event; (full, window bytes, done event).
        Full layers from position `full_from` on, into the target's pages (which start there).
        `writes`: which of decode's pools get which of this rank's heads (tensor parallelism,
        shared/transfer/ipc_ranks.py); by default the target's pool gets every head."""
        writes = [(target.pool, None)] if writes is None else writes
        with self._lock:
            pools = [(self._pools.get(export), run) for export, run in writes]
        if target.ready_event:
            self._opened.wait(target.ready_event)
        full = window_bytes = 0
        for pool, run in pools:
            f, w = push(self.cache, pages, slot, num_tokens, pool, target.pages, target.slot, window=window,
                        full_from=full_from, heads=run)  # fmt: skip
            full, window_bytes = full + f, window_bytes + w
        return full, window_bytes, self._ring.record()


class IpcReceiver:
    """Decode's half: its exported pool, the events it records, and prefill's events it waits on."""

    def __init__(self, cache: KVCache) -> None:
        self.export = export_pool(cache)
        self._ring = EventRing(cache.device)
        self._opened = OpenedEvents(cache.device)

    def ready(self) -> bytes:
        """An event after everything enqueued so far (the reservation's own writes)."""
        return self._ring.record()

    def wait(self, handle: bytes) -> None:
        """Order this stream after prefill's writes (its PrefillDone.cuda_ipc_event)."""
        self._opened.wait(handle)
