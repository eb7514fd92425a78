"""The `nixl` backend: prefill writes a request's KV into decode's reserved pages with one NIXL WRITE.

Cross node, through NIXL's UCX backend (RDMA, NVLink, TCP: whatever UCX finds between the two agents),
from VRAM or DRAM pools alike. Each side registers its whole pool with its own agent once at start-up
(`RegisteredPool`). Decode sends its agent's metadata and the pool's addresses (`NixlPool`) with the
Handshake and with every PrefillRequest, so a prefill that restarted, or one of several behind
round_robin, loads the agent on first sight (add_remote_agent, once per agent) with no handshake state
to lose. `write_descs` says which bytes go where; it mirrors shared/transfer/cuda_ipc.py `push`: full
layers whole pages, sliding layers the ring's filled prefix and the slot's ring_pos row.

Under tensor parallelism each rank's pool holds only its rank's KV heads (`NixlPool.heads`), and a
prefill of a ranks writes into a decode of b: shared/transfer/heads.py `routes` says which prefill rank
writes which heads into which decode rank, and `write_descs` (its `heads`) copies those heads of every
token from their offset in one side's row to their offset in the other's. A copy of whole rows on
both sides is what it is without tensor parallelism: whole pages, merged.

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
    # The model's KV heads a row of this pool holds (a tensor-parallel rank's); None: all of them.
    heads: range | None = None
    # A decode of several tensor-parallel ranks: this is rank 0's pool, these ranks 1..'s, each its own
    # agent (shared/transfer/nixl_ranks.py).
    other_ranks: tuple[NixlPool, ...] = ()

    def tensor(self, name: str) -> NixlTensor:
        return next(t for t in self.tensors if t.name == name)

    def to_pb(self) -> pb.NixlPool:
        heads = self.heads if self.heads is not None else range(0)
        return pb.NixlPool(
            agent_name=self.agent_name, agent_metadata=self.agent_metadata, mem_type=self.mem_type,
            tensors=[pb.NixlTensor(name=t.name, addr=t.addr, nbytes=t.nbytes, device_id=t.device_id,
                                   dtype=t.dtype, shape=list(t.shape)) for t in self.tensors],
            kv_head_start=heads.start, kv_head_count=len(heads),
            other_ranks=[p.to_pb() for p in self.other_ranks],
        )  # fmt: skip

    @classmethod
    def from_pb(cls, msg: pb.NixlPool) -> NixlPool:
        tensors = tuple(
            NixlTensor(t.name, t.addr, t.nbytes, t.device_id, t.dtype, tuple(t.shape)) for t in msg.tensors
        )
        heads = range(msg.kv_head_start, msg.kv_head_start + msg.kv_head_count) if msg.kv_head_count else None
        others = tuple(cls.from_pb(p) for p in msg.other_ranks)
        return cls(msg.agent_name, msg.agent_metadata, msg.mem_type, tensors, heads, others)


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


def check_compatible(mine: dict[str, NixlTensor], theirs: NixlPool, mine_heads: range | None = None) -> None:
    """Raise ValueError unless decode's pool holds rows of the same shape and dtype as ours.

    Where either side says which of the model's KV heads it holds (`mine_heads`, `theirs.heads`: a
    tensor-parallel rank's), the rows may hold different heads, so only their layers, page size, window
    and head size must agree; each side must then hold as many heads as it says, and a side that says
    nothing holds all the model's heads (range(its H)), which the other's must lie within."""
    names = {t.name for t in theirs.tensors}
    if names != {*POOL_TENSORS, PROBE}:
        raise ValueError(f"pool tensors {sorted(names)}, expected {[*POOL_TENSORS, PROBE]}")
    if theirs.mem_type not in ("DRAM", "VRAM"):
        raise ValueError(f"memory type {theirs.mem_type!r}, expected DRAM or VRAM")
    split = mine_heads is not None or theirs.heads is not None
    for t in theirs.tensors:
        ours = mine[t.name]
        if t.dtype != ours.dtype:
            raise ValueError(f"decode's {t.name} is {t.dtype}, ours {ours.dtype}")
        if t.nbytes != math.prod(t.shape) * getattr(torch, ours.dtype).itemsize:  # ours: a known name
            raise ValueError(f"decode's {t.name} is {list(t.shape)} but {t.nbytes} bytes")
        if t.name == PROBE:
            continue
        # [layers, pages or slots, page_size or W, H, D] (ring_pos: no H, D): rows alike but for H, when split
        same = (2, 4) if split and t.name != "ring_pos" else range(2, len(ours.shape))
        if (
            len(t.shape) != len(ours.shape)
            or t.shape[0] != ours.shape[0]
            or any(t.shape[i] != ours.shape[i] for i in same)
        ):
            raise ValueError(f"decode's {t.name} is {list(t.shape)}, ours {list(ours.shape)}: rows differ")
    if split:
        held_theirs = _held("decode's", theirs.tensor("k_pages").shape[3], theirs.heads)
        held_mine = _held("our", mine["k_pages"].shape[3], mine_heads)
        # A side that names no heads holds the model's all: the other's lie within them.
        if theirs.heads is None and not _within(held_mine, held_theirs):
            raise ValueError(f"our KV heads {held_mine} are not in decode's pool of all {len(held_theirs)}")
        if mine_heads is None and not _within(held_theirs, held_mine):
            raise ValueError(f"decode's KV heads {held_theirs} are not in our pool of all {len(held_mine)}")


def _held(side: str, h: int, heads: range | None) -> range:
    """The model's KV heads a pool of `h` heads a row holds, by what it says (`heads`) or all of them."""
    if heads is None:
        return range(h)
    if heads.step != 1 or len(heads) != h:
        raise ValueError(f"{side} pool holds {h} KV heads a row, not heads {heads}")
    return heads


def _within(inner: range, outer: range) -> bool:
    return outer.start <= inner.start and inner.stop <= outer.stop


@dataclass(frozen=True)
class WritePlan:
    """One WRITE: row i of `local` (address, bytes, device) goes to row i of `remote`."""

    local: np.ndarray  # [n, 3] uint64
    remote: np.ndarray
    full_bytes: int
    window_bytes: int  # k + v of the sliding layers (ring_pos rows not counted, as cuda_ipc)


def _rows(
    t: NixlTensor, rows: np.ndarray, row_bytes: int, count: int, units: int = 1, unit_bytes: int = 0,
    offset: int = 0,
) -> np.ndarray:  # fmt: skip
    """Descriptors of `count` bytes at `offset` into each of the first `units` units (`unit_bytes`
    apart: tokens of a page, entries of a ring) of row `rows[i]` of every layer of `t` ([layers, rows,
    ...], each row `row_bytes`), layer-major, then row, then unit."""
    layers, per_layer = t.shape[0], t.shape[1]
    starts = (np.arange(layers, dtype=np.uint64)[:, None] * per_layer + rows[None, :]) * row_bytes + t.addr
    starts = starts[:, :, None] + (np.arange(units, dtype=np.uint64) * unit_bytes + offset)[None, None, :]
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
    full_from: int = 0, src_heads: range | None = None, dst_heads: range | None = None,
    heads: range | None = None, ring_pos: bool = True,
) -> WritePlan:  # fmt: skip
    """What one request's WRITE moves, as cuda_ipc's `push` does: the prompt's pages of every full
    layer from position `full_from` on (a page boundary: decode holds the ones before, shared; its
    `dst_pages[0]` is the page for `full_from`), whole (a last page's tail past the prompt is decode's
    to overwrite before it reads it), and with `history` the first min(num_tokens, W) ring entries of
    every sliding layer (position p sits at index p % W) and, with `ring_pos`, the slot's whole ring_pos
    row, so positions without history read as absent.

    Of every token and ring entry only KV heads `heads` (the model's numbers; None: all of `src_heads`)
    are copied, from their offset in our row, which holds `src_heads` (None: our pool's H, from 0), to
    their offset in decode's, which holds `dst_heads` (None: `theirs.heads`, else its H from 0). Heads
    outside either side raise ValueError. Whole rows on both sides give whole pages, as without heads."""
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
    src_heads = _held("our", mine["k_pages"].shape[3], src_heads)
    dst_heads = _held("decode's", dk.shape[3], theirs.heads if dst_heads is None else dst_heads)
    heads = src_heads if heads is None else heads
    if not heads or heads.step != 1:
        raise ValueError(f"KV heads {heads}: not a contiguous run of heads to copy")
    for side, held in (("our", src_heads), ("decode's", dst_heads)):
        if not _within(heads, held):
            raise ValueError(f"KV heads {heads} are not all in {side} pool (it holds {held})")
    # Whole rows on both sides: one descriptor a page (a ring's filled prefix), as without heads;
    # otherwise one a token (a ring entry): the heads' bytes, at their offset on either side.
    whole = heads == src_heads == dst_heads
    local: list[np.ndarray] = []
    remote: list[np.ndarray] = []

    def copy(name: str, s: np.ndarray, t: np.ndarray, units: int) -> int:
        """Describe the first `units` tokens (ring entries) of rows `s` of ours into rows `t` of
        decode's `name`, every layer; the bytes they move."""
        ours, dst = mine[name], d[name]
        row, row_r = _row_bytes(ours), _row_bytes(dst)
        unit, unit_r = row // ours.shape[2], row_r // dst.shape[2]
        if whole:
            local.append(_rows(ours, s, row, unit * units))
            remote.append(_rows(dst, t, row_r, unit * units))
            return ours.shape[0] * len(s) * unit * units
        head = unit // len(src_heads)
        count = len(heads) * head
        local.append(_rows(ours, s, row, count, units, unit, (heads.start - src_heads.start) * head))
        remote.append(_rows(dst, t, row_r, count, units, unit_r, (heads.start - dst_heads.start) * head))
        return ours.shape[0] * len(s) * units * count

    full, window_bytes = 0, 0
    if mine["k_pages"].shape[0] and need:
        s = np.asarray(pages[skip : skip + need], dtype=np.uint64)
        t = np.asarray(dst_pages[:need], dtype=np.uint64)
        full = copy("k_pages", s, t, page_size) + copy("v_pages", s, t, page_size)
    if history and mine["k_ring"].shape[0] and num_tokens:
        s, t = np.asarray([slot], dtype=np.uint64), np.asarray([dst_slot], dtype=np.uint64)
        filled = min(num_tokens, window)
        window_bytes = copy("k_ring", s, t, filled) + copy("v_ring", s, t, filled)
        if ring_pos:  # the same on every rank and of no head: whole, from one source (heads.py)
            row = _row_bytes(mine["ring_pos"])
            local.append(_rows(mine["ring_pos"], s, row, row))
            remote.append(_rows(d["ring_pos"], t, _row_bytes(d["ring_pos"]), row))
    if not local:
        empty = np.empty((0, 3), dtype=np.uint64)
        return WritePlan(empty, empty, 0, 0)
    a, b = _merge(np.concatenate(local), np.concatenate(remote))
    return WritePlan(a, b, full, window_bytes)


def _row_bytes(t: NixlTensor) -> int:
    """Bytes of one row (a page, a slot's ring) of `t` [layers, rows, ...]."""
    return t.nbytes // max(t.shape[0] * t.shape[1], 1)
