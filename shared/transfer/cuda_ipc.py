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

import contextlib
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from shared.kv.cache import KVCache
from shared.pb.pdserve.v1 import cuda_ipc_pb2 as pb
from shared.transfer.copy_rows import copy_rows
from shared.transfer.ipc_events import EventRing, OpenedEvents

__all__ = [
    "EventRing", "IpcReceiver", "IpcTarget", "IpcUnavailable", "IpcWriter", "OpenedEvents", "PeerPool",
    "PeerPools", "PoolExport", "export_pool", "push",
]  # fmt: skip

POOL_TENSORS = ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos")
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class IpcUnavailable(RuntimeError):
    """cuda_ipc cannot work here (no CUDA, no cuda-bindings, GPU not visible, expandable segments)."""


def _driver():  # the cuda.bindings driver module
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise IpcUnavailable("the cuda_ipc backend needs the cuda-bindings package (pdserve[gpu])") from e
    return driver


def _runtime():  # the cuda.bindings runtime module
    _driver()
    from cuda.bindings import runtime

    return runtime


@contextlib.contextmanager
def _current(device: torch.device) -> Iterator[None]:
    """`device`'s primary context current on this thread, whatever thread this is.

    torch.cuda.device skips cudaSetDevice when the thread's device index already matches, which leaves a
    fresh thread (a gRPC worker, asyncio.to_thread) without a current context; the driver calls below
    need one. A runtime call (cudaFree(0)) creates and binds it.
    """
    with torch.cuda.device(device):
        _ok(_runtime().cudaFree(0), "cudaFree(0)")
        yield


def _ok(result: tuple, what: str) -> tuple:  # type: ignore[type-arg]
    err, *rest = result
    if int(err) != 0:
        raise IpcUnavailable(f"{what} failed: {err!r}")
    return tuple(rest)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def device_of_uuid(gpu: str) -> torch.device:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", i)) == gpu:
            return torch.device("cuda", i)
    raise IpcUnavailable(
        f"decode's GPU {gpu} is not visible to this process: cuda_ipc needs decode's GPU among this "
        "process's devices (CUDA_VISIBLE_DEVICES / the pod's device list) and a shared IPC namespace"
    )


@dataclass(frozen=True)
class IpcTensor:
    name: str
    handle: bytes  # CUipcMemHandle of the allocation holding the tensor
    offset: int  # bytes from the allocation's base to the tensor's first element
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PoolExport:
    pool_id: str  # unique per decode process: prefill's mapping cache key
    gpu_uuid: str
    tensors: tuple[IpcTensor, ...]

    def to_pb(self) -> pb.CudaIpcPool:
        return pb.CudaIpcPool(
            pool_id=self.pool_id, gpu_uuid=self.gpu_uuid,
            tensors=[pb.CudaIpcTensor(name=t.name, handle=t.handle, offset=t.offset, dtype=t.dtype,
                                      shape=list(t.shape)) for t in self.tensors],
        )  # fmt: skip

    @classmethod
    def from_pb(cls, msg: pb.CudaIpcPool) -> PoolExport:
        tensors = tuple(IpcTensor(t.name, t.handle, t.offset, t.dtype, tuple(t.shape)) for t in msg.tensors)
        return cls(msg.pool_id, msg.gpu_uuid, tensors)


def export_pool(cache: KVCache) -> PoolExport:
    """IPC handles of decode's whole KV pool, made once at start-up."""
    if cache.device.type != "cuda":
        raise IpcUnavailable("cuda_ipc needs the KV cache on a CUDA device")
    drv = _driver()
    out = []
    with _current(cache.device):
        for name in POOL_TENSORS:
            t = getattr(cache, name)
            if not t.is_contiguous():
                raise IpcUnavailable(f"KVCache.{name} must be contiguous to be exported")
            base, _size = _ok(drv.cuMemGetAddressRange(t.data_ptr()), "cuMemGetAddressRange")
            try:
                (handle,) = _ok(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
            except IpcUnavailable as e:  # memory from cuMemCreate (expandable segments) has no IPC handle
                raise IpcUnavailable(f"{e}; is PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set?") from e
            dtype = str(t.dtype).removeprefix("torch.")
            offset = t.data_ptr() - int(base)
            out.append(IpcTensor(name, bytes(handle.reserved), offset, dtype, tuple(t.shape)))
    return PoolExport(uuid.uuid4().hex, gpu_uuid(cache.device), tuple(out))


class _PeerTensor:
    """A tensor of decode's pool as seen from prefill: a pointer Triton can write through."""

    def __init__(self, ptr: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.ptr, self.dtype, self.shape = ptr, dtype, shape

    def data_ptr(self) -> int:
        return self.ptr


class PeerPool:
    """Decode's pool mapped into this process, in the context of `device` (this process's GPU)."""

    def __init__(self, export: PoolExport, device: torch.device, like: KVCache) -> None:
        self.pool_id, self.device = export.pool_id, device
        self.peer_device = device_of_uuid(export.gpu_uuid)  # raises when not visible
        drv = _driver()
        names = {t.name for t in export.tensors}
        if names != set(POOL_TENSORS):
            raise IpcUnavailable(f"pool export names {sorted(names)}, expected {list(POOL_TENSORS)}")
        self._bases: dict[bytes, int] = {}
        self.tensors: dict[str, _PeerTensor] = {}
        with _current(device):
            for t in export.tensors:
                mine = getattr(like, t.name)
                if t.dtype != str(mine.dtype).removeprefix("torch.") or t.shape[0] != mine.shape[0]:
                    raise IpcUnavailable(f"decode's {t.name} is {t.dtype}{list(t.shape)}, ours {mine.dtype}")
                if t.shape[2:] != tuple(mine.shape[2:]):
                    theirs, ours = t.shape[2:], tuple(mine.shape[2:])
                    raise IpcUnavailable(f"decode's {t.name} rows are {theirs}, ours {ours}")
                if t.handle not in self._bases:
                    h = drv.CUipcMemHandle()
                    h.reserved = t.handle
                    (base,) = _ok(drv.cuIpcOpenMemHandle(h, _LAZY_PEER_ACCESS), "cuIpcOpenMemHandle")
                    self._bases[t.handle] = int(base)
                self.tensors[t.name] = _PeerTensor(self._bases[t.handle] + t.offset, mine.dtype, t.shape)

    def close(self) -> None:
        drv = _driver()
        with _current(self.device):
            for base in self._bases.values():
                drv.cuIpcCloseMemHandle(base)
        self._bases.clear()


class PeerPools:
    """Mapped decode pools by pool_id (a few: one per decode process on this node), oldest unmapped first.

    An evicted pool is unmapped once the writes already enqueued into it have run (an event query).
    """

    def __init__(self, device: torch.device, like: KVCache, limit: int = 8) -> None:
        self.device, self.like, self.limit = device, like, limit
        self._pools: OrderedDict[str, PeerPool] = OrderedDict()
        self._closing: list[tuple[torch.cuda.Event, PeerPool]] = []

    def get(self, export: PoolExport) -> PeerPool:
        self._closing = [(ev, p) for ev, p in self._closing if not (ev.query() and p.close() is None)]
        pool = self._pools.get(export.pool_id)
        if pool is None:
            pool = self._pools[export.pool_id] = PeerPool(export, self.device, self.like)
            if len(self._pools) > self.limit:
                _, old = self._pools.popitem(last=False)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self._closing.append((ev, old))
        self._pools.move_to_end(export.pool_id)
        return pool


def _upload(values: Sequence[int], device: torch.device) -> torch.Tensor:
    # Pinned, so the copy is asynchronous: a copy from pageable memory would make the host wait.
    return torch.tensor(values, dtype=torch.int32).pin_memory().to(device, non_blocking=True)


def _by_row(t: torch.Tensor | _PeerTensor, rows_from: int) -> tuple[int, ...]:
    """`t`'s shape as [layers, rows, row elements], the row being dims rows_from.. merged."""
    shape = t.shape
    return (shape[0], math.prod(shape[1:rows_from]), math.prod(shape[rows_from:]))


def push(
    src: KVCache, pages: Sequence[int], slot: int, num_tokens: int, dst: PeerPool,
    dst_pages: Sequence[int], dst_slot: int, *, window: bool,
) -> tuple[int, int]:  # fmt: skip
    """Enqueue the writes of a prompt's KV into decode's reservation; (full bytes, window bytes).

    Full layers: the prompt's pages, whole (a last page's tail past the prompt is decode's to
    overwrite before it reads it). Sliding layers (`window`): the ring's filled part, which is its
    first min(num_tokens, W) entries (position p sits at index p % W), and the slot's whole ring_pos
    row, so positions without history read as absent. Three small index uploads; no other host work.
    """
    t = dst.tensors
    need = src.pages_needed(num_tokens)
    if len(dst_pages) < need or t["k_pages"].shape[2] != src.page_size:
        raise ValueError(f"{len(dst_pages)} destination pages of {t['k_pages'].shape[2]} cannot hold "
                         f"{num_tokens} tokens in pages of {src.page_size}")  # fmt: skip
    if any(not 0 <= p < t["k_pages"].shape[1] for p in dst_pages[:need]):
        raise ValueError("destination page outside decode's pool")
    if not 0 <= dst_slot < t["k_ring"].shape[1]:
        raise ValueError(f"destination slot {dst_slot} outside decode's pool")
    dev, full, window_bytes = src.device, 0, 0
    if src.full_layers and need:
        s, d = _upload(pages[:need], dev), _upload(dst_pages[:need], dev)
        for name in ("k_pages", "v_pages"):
            pool = getattr(src, name)
            copy_rows(pool.view(_by_row(pool, 2)), t[name], _by_row(t[name], 2), s, d)
            full += pool[:, 0].numel() * need * pool.element_size()
    if window and src.sliding_layers and num_tokens:
        s, d = _upload([slot], dev), _upload([dst_slot], dev)
        filled = min(num_tokens, src.window)
        for name in ("k_ring", "v_ring"):
            pool = getattr(src, name)
            per_entry = pool[0, 0, 0].numel()
            copy_rows(pool.view(_by_row(pool, 2)), t[name], _by_row(t[name], 2), s, d, filled * per_entry)
            window_bytes += pool.shape[0] * filled * per_entry * pool.element_size()
        copy_rows(src.ring_pos, t["ring_pos"], t["ring_pos"].shape, s, d)
    return full, window_bytes


@dataclass(frozen=True)
class IpcTarget:
    """Where one request's KV goes in decode's pool, and the events and lease that guard it."""

    pool: PoolExport
    pages: tuple[int, ...]
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

    def write(
        self, pages: Sequence[int], slot: int, num_tokens: int, target: IpcTarget, *, window: bool
    ) -> tuple[int, int, bytes]:
        """Enqueue the request's KV writes after decode's ready event; (full, window bytes, done event)."""
        with self._lock:
            pool = self._pools.get(target.pool)
        if target.ready_event:
            self._opened.wait(target.ready_event)
        full, window_bytes = push(self.cache, pages, slot, num_tokens, pool, target.pages, target.slot,
                                  window=window)  # fmt: skip
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
