"""The `nixl` backend: prefill writes a request's KV into decode's reserved pages with one NIXL WRITE.

Cross node, through NIXL's UCX backend (RDMA, NVLink, TCP: whatever UCX finds between the two agents),
from VRAM or DRAM pools alike. Each side registers its whole pool with its own agent once at start-up
(`RegisteredPool`). Decode sends its agent's metadata and the pool's addresses (`NixlPool`) with the
Handshake and with every PrefillRequest, so a prefill that restarted, or one of several behind
round_robin, loads the agent on first sight (add_remote_agent, once per agent) with no handshake state
to lose. `write_descs` says which bytes go where; it mirrors shared/transfer/cuda_ipc.py `push`: full
layers whole pages, sliding layers the ring's filled prefix and the slot's ring_pos row.

The NIXL package is optional (`pdserve[nixl]`): it is imported only when this backend is chosen
(`load_api`); importing this module needs torch and numpy only. Agent metadata and addresses cross the
wire as bytes and integers (shared/pb nixl.proto), never pickle. The prefill half is
shared/transfer/nixl_writer.py.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shared.engine.kv.cache import KVCache
from shared.pb.pdserve.v1 import nixl_pb2 as pb

__all__ = [
    "ABANDON_AFTER_LEASE_S", "POOL_TENSORS", "PROBE", "NixlError", "NixlPool", "NixlReceiver", "NixlTarget",
    "NixlTensor", "NixlUnavailable", "RegisteredPool", "WritePlan", "bind_device", "check_compatible",
    "load_api", "new_agent", "nixl_available", "write_descs",
]  # fmt: skip

POOL_TENSORS = ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos")
PROBE = "probe"  # a small buffer of decode's the handshake writes into: proves the data path end to end
PROBE_BYTES = 64
# Prefill gives up on (cancels) a WRITE still running this long after its lease; decode frees the pages of
# an abandoned transfer only after a longer grace (decode_service/scheduler.py WRITE_GRACE_S).
ABANDON_AFTER_LEASE_S = 2.0
# The UCX progress thread's poll() timeout (NIXL's pthrDelay, microseconds). NIXL's Python API starts it
# with 0: a poll() that never blocks, a whole core per process even idle. UCX wakes the thread through
# its event fd whenever a worker has work (a WRITE landing over TCP, a connection being set up), so the
# timeout only bounds a missed wake-up; at 1 ms an idle agent costs ~3% of a core.
PROGRESS_POLL_US = 1000
_config_lock = threading.Lock()


class NixlUnavailable(RuntimeError):
    """The nixl backend cannot work in this process (package missing, no UCX backend)."""


class NixlError(RuntimeError):
    """A NIXL call failed: an agent that cannot be reached, a transfer that ended in error."""


def nixl_available() -> bool:
    """Whether a NIXL package is installed (without importing it)."""
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu13", "nixl_cu12"))


def load_api() -> tuple[Any, Any]:
    """`nixl_agent` and `nixl_agent_config`, imported on first use."""
    # The `nixl` meta package picks the build matching torch's CUDA; pdserve[nixl] installs only the
    # CUDA 13 build (the meta package pulls in both), whose module is nixl_cu13.
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent", "nixl_agent_config"])
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise NixlUnavailable("the nixl backend needs the NIXL package: pip install 'pdserve[nixl]'")


def _construct(agent_cls: Any, config_cls: Any, name: str) -> Any:
    """`agent_cls(name, config)`, its progress thread polling every PROGRESS_POLL_US.

    nixl_agent builds its binding's config itself and sets `pthrDelay = 0` on it, with no argument to
    change that; while it runs, the binding's config class is swapped for one whose pthrDelay keeps
    ours (agents are made once per process, at start-up). A NIXL without that binding (another
    version) gets NIXL's own behaviour."""
    bindings = getattr(sys.modules.get(agent_cls.__module__), "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    delay = getattr(base, "pthrDelay", None)
    if delay is None:
        return agent_cls(name, config_cls(backends=["UCX"]))

    class _PolledConfig(base):
        pthrDelay = property(delay.__get__, lambda self, _: delay.__set__(self, PROGRESS_POLL_US))

    with _config_lock:
        bindings.nixlAgentConfig = _PolledConfig
        try:
            return agent_cls(name, config_cls(backends=["UCX"]))
        finally:
            bindings.nixlAgentConfig = base


def new_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend, named uniquely for this process (`pdserve-ROLE-<hex>`)."""
    agent_cls, config_cls = load_api()
    name = f"pdserve-{role}-{uuid.uuid4().hex[:12]}"
    try:
        agent = _construct(agent_cls, config_cls, name)
    except Exception as e:  # NIXL's errors share no base class but Exception
        raise NixlUnavailable(f"cannot start a NIXL agent with the UCX backend: {e!r}") from e
    if "UCX" not in agent.backends:  # a missing plugin is only logged by NIXL
        raise NixlUnavailable(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
    return agent


def bind_device(device: torch.device) -> None:
    """Make `device`'s primary context current on this thread: UCX's CUDA transports register and copy
    in the current context, and a fresh thread (a gRPC worker, asyncio.to_thread) has none. A stream
    query is a runtime call that binds it without waiting for anything."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.current_stream(device).query()


def mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


@dataclass(frozen=True)
class NixlTensor:
    name: str
    addr: int  # in the owning process
    nbytes: int
    device_id: int  # CUDA index in the owning process; 0 for DRAM
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> NixlTensor:
        dev = t.device.index if t.device.type == "cuda" and t.device.index is not None else 0
        dtype = str(t.dtype).removeprefix("torch.")
        return cls(name, t.data_ptr(), t.numel() * t.element_size(), dev, dtype, tuple(t.shape))


@dataclass(frozen=True)
class NixlPool:
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    tensors: tuple[NixlTensor, ...]

    def tensor(self, name: str) -> NixlTensor:
        return next(t for t in self.tensors if t.name == name)

    def to_pb(self) -> pb.NixlPool:
        return pb.NixlPool(
            agent_name=self.agent_name, agent_metadata=self.agent_metadata, mem_type=self.mem_type,
            tensors=[pb.NixlTensor(name=t.name, addr=t.addr, nbytes=t.nbytes, device_id=t.device_id,
                                   dtype=t.dtype, shape=list(t.shape)) for t in self.tensors],
        )  # fmt: skip

    @classmethod
    def from_pb(cls, msg: pb.NixlPool) -> NixlPool:
        tensors = tuple(
            NixlTensor(t.name, t.addr, t.nbytes, t.device_id, t.dtype, tuple(t.shape)) for t in msg.tensors
        )
        return cls(msg.agent_name, msg.agent_metadata, msg.mem_type, tensors)


@dataclass(frozen=True)
class NixlTarget:
    """Where one request's KV goes in decode's pool, and the lease that guards it."""

    pool: NixlPool
    pages: tuple[int, ...]  # decode's reserved pages from PrefillRequest.cached_tokens on
    slot: int
    lease_deadline_ns: int  # unix epoch ns: no write is started after it

    def to_pb(self) -> pb.NixlTarget:
        return pb.NixlTarget(
            pool=self.pool.to_pb(), pages=list(self.pages), slot=self.slot,
            lease_deadline_unix_ns=self.lease_deadline_ns,
        )  # fmt: skip

    @classmethod
    def from_pb(cls, msg: pb.NixlTarget) -> NixlTarget:
        return cls(NixlPool.from_pb(msg.pool), tuple(msg.pages), msg.slot, msg.lease_deadline_unix_ns)


class RegisteredPool:
    """A KV cache's tensors and a probe buffer, registered with `agent` once (both sides have one).

    The cache's tensors are allocated once and never move, so the registration stays valid for the
    process's life; `agent` must outlive it.
    """

    def __init__(self, agent: Any, cache: KVCache) -> None:
        self.agent, self.device, self.mem_type = agent, cache.device, mem_type(cache.device)
        bind_device(cache.device)
        self.probe = torch.arange(PROBE_BYTES, dtype=torch.uint8, device=cache.device)
        named = [(n, getattr(cache, n)) for n in POOL_TENSORS] + [(PROBE, self.probe)]
        for n, t in named:
            if not t.is_contiguous():
                raise NixlUnavailable(f"KVCache.{n} must be contiguous to be registered")
        self.tensors = tuple(NixlTensor.of(n, t) for n, t in named)
        regs = np.array([[t.addr, t.nbytes, t.device_id] for t in self.tensors], dtype=np.uint64)
        try:
            self.reg = agent.register_memory(regs, self.mem_type)
        except Exception as e:
            raise NixlUnavailable(f"cannot register the KV pool ({self.mem_type}) with NIXL: {e!r}") from e
        self.by_name = {t.name: t for t in self.tensors}

    def export(self) -> NixlPool:
        return NixlPool(self.agent.name, bytes(self.agent.get_agent_metadata()), self.mem_type, self.tensors)


class NixlReceiver:
    """Decode's half: its agent and registered pool. Prefill does the writes; nothing runs here per
    request (the reservation's pages are plain memory that UCX fills)."""

    def __init__(self, cache: KVCache) -> None:
        bind_device(cache.device)  # before the agent: UCX looks for a CUDA context when it starts
        self.agent = new_agent("decode")
        self.pool = RegisteredPool(self.agent, cache)
        self.export = self.pool.export()


def check_compatible(mine: dict[str, NixlTensor], theirs: NixlPool) -> None:
    """Raise ValueError unless decode's pool holds rows of the same shape and dtype as ours."""
    names = {t.name for t in theirs.tensors}
    if names != {*POOL_TENSORS, PROBE}:
        raise ValueError(f"pool tensors {sorted(names)}, expected {[*POOL_TENSORS, PROBE]}")
    if theirs.mem_type not in ("DRAM", "VRAM"):
        raise ValueError(f"memory type {theirs.mem_type!r}, expected DRAM or VRAM")
    for t in theirs.tensors:
        ours = mine[t.name]
        if t.dtype != ours.dtype:
            raise ValueError(f"decode's {t.name} is {t.dtype}, ours {ours.dtype}")
        if t.nbytes != math.prod(t.shape) * getattr(torch, ours.dtype).itemsize:  # ours: a known name
            raise ValueError(f"decode's {t.name} is {list(t.shape)} but {t.nbytes} bytes")
        if t.name != PROBE and (t.shape[0] != ours.shape[0] or t.shape[2:] != ours.shape[2:]):
            raise ValueError(f"decode's {t.name} is {list(t.shape)}, ours {list(ours.shape)}: rows differ")


@dataclass(frozen=True)
class WritePlan:
    """One WRITE: row i of `local` (address, bytes, device) goes to row i of `remote`."""

    local: np.ndarray  # [n, 3] uint64
    remote: np.ndarray
    full_bytes: int
    window_bytes: int  # k + v of the sliding layers (ring_pos rows not counted, as cuda_ipc)


def _rows(t: NixlTensor, rows: np.ndarray, row_bytes: int, count: int) -> np.ndarray:
    """Descriptors of `count` bytes at the start of row `rows[i]` of every layer of `t` ([layers, rows,
    ...], each row `row_bytes`), layer-major."""
    layers, per_layer = t.shape[0], t.shape[1]
    starts = (np.arange(layers, dtype=np.uint64)[:, None] * per_layer + rows[None, :]) * row_bytes + t.addr
    out = np.empty((starts.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = starts.ravel(), count, t.device_id
    return out


def _merge(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Join neighbours that are contiguous on both sides (consecutive pages): fewer, larger descriptors."""
    if len(local) < 2:
        return local, remote
    ends_l, ends_r = local[:-1, 0] + local[:-1, 1], remote[:-1, 0] + remote[:-1, 1]
    follows = (local[1:, 0] == ends_l) & (remote[1:, 0] == ends_r)
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    a, b = local[starts], remote[starts]
    a[:, 1] = b[:, 1] = np.add.reduceat(local[:, 1], starts)
    return a, b


def write_descs(
    mine: dict[str, NixlTensor], theirs: NixlPool, page_size: int, window: int, pages: Sequence[int],
    slot: int, num_tokens: int, dst_pages: Sequence[int], dst_slot: int, *, history: bool,
    full_from: int = 0,
) -> WritePlan:  # fmt: skip
    """What one request's WRITE moves, as cuda_ipc's `push` does: the prompt's pages of every full
    layer from position `full_from` on (a page boundary: decode holds the ones before, shared; its
    `dst_pages[0]` is the page for `full_from`), whole (a last page's tail past the prompt is decode's
    to overwrite before it reads it), and with `history` the first min(num_tokens, W) ring entries of
    every sliding layer (position p sits at index p % W) and the slot's whole ring_pos row, so positions
    without history read as absent."""
    d = {t.name: t for t in theirs.tensors}
    if full_from % page_size or not 0 <= full_from < max(num_tokens, 1):
        raise ValueError(f"full_from {full_from}: no page boundary within {num_tokens} tokens")
    skip = full_from // page_size
    need = -(-num_tokens // page_size) - skip
    dk = d["k_pages"]
    if len(dst_pages) < need or (dk.shape[2] != page_size):
        raise ValueError(f"{len(dst_pages)} destination pages of {dk.shape[2]} cannot hold "
                         f"tokens [{full_from}, {num_tokens}) in pages of {page_size}")  # fmt: skip
    if any(not 0 <= p < dk.shape[1] for p in dst_pages[:need]):
        raise ValueError("destination page outside decode's pool")
    if not 0 <= dst_slot < d["k_ring"].shape[1]:
        raise ValueError(f"destination slot {dst_slot} outside decode's pool")
    local, remote, full, window_bytes = [], [], 0, 0
    if mine["k_pages"].shape[0] and need:
        s = np.asarray(pages[skip : skip + need], dtype=np.uint64)
        t = np.asarray(dst_pages[:need], dtype=np.uint64)
        for name in ("k_pages", "v_pages"):
            row = mine[name].nbytes // max(mine[name].shape[0] * mine[name].shape[1], 1)
            local.append(_rows(mine[name], s, row, row))
            remote.append(_rows(d[name], t, row, row))
            full += mine[name].shape[0] * need * row
    if history and mine["k_ring"].shape[0] and num_tokens:
        s, t = np.asarray([slot], dtype=np.uint64), np.asarray([dst_slot], dtype=np.uint64)
        filled = min(num_tokens, window)
        for name in ("k_ring", "v_ring", "ring_pos"):
            row = mine[name].nbytes // (mine[name].shape[0] * mine[name].shape[1])
            count = row if name == "ring_pos" else row // mine[name].shape[2] * filled
            local.append(_rows(mine[name], s, row, count))
            remote.append(_rows(d[name], t, row, count))
            window_bytes += 0 if name == "ring_pos" else mine[name].shape[0] * count
    if not local:
        empty = np.empty((0, 3), dtype=np.uint64)
        return WritePlan(empty, empty, 0, 0)
    a, b = _merge(np.concatenate(local), np.concatenate(remote))
    return WritePlan(a, b, full, window_bytes)
