"""CUDA IPC memory for the cuda_ipc backend: decode's pool exported as handles, mapped by prefill.

Decode exports each pool tensor once (`export_pool`): the CUDA IPC handle of the allocation holding it,
the tensor's offset in that allocation, and the GPU's UUID (device indices differ between processes).
Prefill maps an export in its own GPU's context with lazy peer access (`PeerPool`), so kernels on its
GPU can store into decode's memory, over NVLink when the two are on different GPUs.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shared.engine.kv.cache import KVCache
from shared.pb.pdserve.v1 import cuda_ipc_pb2 as pb

__all__ = [
    "POOL_TENSORS", "IpcTensor", "IpcUnavailable", "PeerPool", "PeerPools", "PeerTensor", "PoolExport",
    "device_of_uuid", "export_pool", "gpu_uuid",
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
    # The model's KV heads a row of this pool holds (a tensor-parallel rank's); None: all of them.
    heads: range | None = None
    # A decode of several ranks: rank 0's export carries ranks 1.. in order (shared/transfer/ipc_ranks.py).
    other_ranks: tuple[PoolExport, ...] = ()

    def to_pb(self) -> pb.CudaIpcPool:
        heads = self.heads if self.heads is not None else range(0)
        return pb.CudaIpcPool(
            pool_id=self.pool_id, gpu_uuid=self.gpu_uuid,
            tensors=[pb.CudaIpcTensor(name=t.name, handle=t.handle, offset=t.offset, dtype=t.dtype,
                                      shape=list(t.shape)) for t in self.tensors],
            kv_head_start=heads.start, kv_head_count=len(heads),
            other_ranks=[p.to_pb() for p in self.other_ranks],
        )  # fmt: skip

    @classmethod
    def from_pb(cls, msg: pb.CudaIpcPool) -> PoolExport:
        tensors = tuple(IpcTensor(t.name, t.handle, t.offset, t.dtype, tuple(t.shape)) for t in msg.tensors)
        heads = range(msg.kv_head_start, msg.kv_head_start + msg.kv_head_count) if msg.kv_head_count else None
        others = tuple(cls.from_pb(p) for p in msg.other_ranks)
        return cls(msg.pool_id, msg.gpu_uuid, tensors, heads, others)

    def ranks(self) -> list[PoolExport]:
        """Decode's pools in rank order: this one (rank 0's), then `other_ranks`."""
        return [self, *self.other_ranks]


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


class PeerTensor:
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
        self.tensors: dict[str, PeerTensor] = {}
        with _current(device):
            for t in export.tensors:
                mine = getattr(like, t.name)
                if t.dtype != str(mine.dtype).removeprefix("torch.") or t.shape[0] != mine.shape[0]:
                    raise IpcUnavailable(f"decode's {t.name} is {t.dtype}{list(t.shape)}, ours {mine.dtype}")
                # Either side may hold a share of the KV heads (a tensor-parallel rank's): the rest of a
                # row must agree, and a pool that names its heads holds that many. Which heads go where,
                # and that they lie within both rows: ipc_ranks.py and copy_heads.
                theirs, ours = t.shape[2:], tuple(mine.shape[2:])
                rows = (
                    (theirs[:1] + theirs[2:], ours[:1] + ours[2:]) if t.name != "ring_pos" else (theirs, ours)
                )
                if rows[0] != rows[1] or len(theirs) != len(ours):
                    raise IpcUnavailable(f"decode's {t.name} rows are {theirs}, ours {ours}")
                if export.heads is not None and t.name != "ring_pos" and theirs[1] != len(export.heads):
                    raise IpcUnavailable(
                        f"decode's {t.name} rows hold {theirs[1]} KV heads, not {export.heads}"
                    )
                if t.handle not in self._bases:
                    h = drv.CUipcMemHandle()
                    h.reserved = t.handle
                    (base,) = _ok(drv.cuIpcOpenMemHandle(h, _LAZY_PEER_ACCESS), "cuIpcOpenMemHandle")
                    self._bases[t.handle] = int(base)
                self.tensors[t.name] = PeerTensor(self._bases[t.handle] + t.offset, mine.dtype, t.shape)

    def close(self) -> None:
        drv = _driver()
        with _current(self.device):
            for base in self._bases.values():
                drv.cuIpcCloseMemHandle(base)
        self._bases.clear()


class PeerPools:
    """Mapped decode pools by pool_id (a few: one per decode process, or rank, on this node), oldest
    unmapped first.

    An evicted pool is unmapped once the writes already enqueued into it have run (an event query).
    """

    def __init__(self, device: torch.device, like: KVCache, limit: int = 64) -> None:
        self.device, self.like, self.limit = device, like, limit
        self._pools: OrderedDict[str, PeerPool] = OrderedDict()
        self._closing: list[tuple[torch.cuda.Event, PeerPool]] = []

    def __contains__(self, pool_id: str) -> bool:
        return pool_id in self._pools

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
