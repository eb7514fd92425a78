"""Prefill's half of the `nixl` backend: its agent and registered pool, the decode agents it has loaded,
and the WRITEs it has in flight.

Decode's agents are loaded (add_remote_agent) once each, by name, off the scheduler thread: at the
Handshake (`probe`, which also writes a few bytes into decode's probe buffer, so an agent this process
cannot reach fails there) or before a request is submitted (`connect`). The scheduler thread only starts
WRITEs (`start`) and polls them (`poll`), and never waits: the agent is not thread-safe, and a call
made while a handshake holds it (connecting may take a while) returns None, to be retried on the
loop's next iteration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from shared.engine.kv.cache import KVCache
from shared.transfer.nixl import (
    PROBE,
    NixlError,
    NixlPool,
    NixlTarget,
    RegisteredPool,
    bind_device,
    check_compatible,
    new_agent,
    write_descs,
)

__all__ = ["Heads", "NixlTransfer", "NixlWriter"]

T = TypeVar("T")
_PROBE_WRITE = 8  # bytes of the handshake's probe write


@dataclass(frozen=True)
class Heads:
    """A WRITE's share of the KV heads (`write_descs`' arguments): the model's heads our pool and
    theirs hold, the ones this WRITE copies, and whether it carries the slot's ring_pos row."""

    src_heads: range
    dst_heads: range
    heads: range
    ring_pos: bool


@dataclass
class NixlTransfer:
    """One request's WRITE into decode's pool."""

    agent_name: str
    handle: Any  # nixl_xfer_handle; None: nothing to move (no byte of KV), done at once
    full_bytes: int
    window_bytes: int
    state: str  # PROC | DONE | ERR
    error: str = ""
    started_ns: int = 0


class NixlWriter:
    def __init__(self, cache: KVCache, max_peers: int = 64, heads: range | None = None) -> None:
        self.cache = cache
        self.heads = heads  # the model's KV heads our pool holds (a tensor-parallel rank's); None: all
        bind_device(cache.device)  # before the agent: UCX looks for a CUDA context when it starts
        self.agent = new_agent("prefill")
        self.pool = RegisteredPool(self.agent, cache)
        self._lock = threading.Lock()  # guards the agent (sync mode NONE) and the tables below
        self._peers: OrderedDict[str, NixlPool] = OrderedDict()  # loaded decode agents, oldest first
        self._busy: Counter[str] = Counter()  # WRITEs in flight per agent: never unloaded meanwhile
        self.max_peers = max_peers

    # ---- any thread but the scheduler's (may block on the network) ----

    def connect(self, pool: NixlPool) -> None:
        """Load decode's agent unless it is loaded already. Raises ValueError when its pool does not fit
        ours, NixlError when the agent cannot be loaded (UCX cannot connect to it)."""
        with self._lock:
            if pool.agent_name in self._peers:
                self._peers.move_to_end(pool.agent_name)
                return
        check_compatible(self.pool.by_name, pool, self.heads)
        bind_device(self.cache.device)
        with self._lock:
            if pool.agent_name in self._peers:
                return
            try:
                loaded = self.agent.add_remote_agent(pool.agent_metadata)
            except Exception as e:  # NIXL's errors share no base class but Exception
                raise NixlError(f"cannot load decode's NIXL agent {pool.agent_name}: {e!r}") from e
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != pool.agent_name:
                self._forget(name)
                raise NixlError(f"agent metadata names {name!r}, not {pool.agent_name!r}")
            self._peers[name] = pool
            self._evict()

    def connected(self, agent_name: str) -> bool:
        """Whether decode's agent is loaded (False too while a handshake holds the agent: never waits)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return agent_name in self._peers
        finally:
            self._lock.release()

    def probe(self, pool: NixlPool, timeout_s: float = 10.0) -> None:
        """Load decode's agent and write into its probe buffer, waiting for the write (handshake only)."""
        self.connect(pool)
        local = self._probe_desc(self.pool.by_name[PROBE])
        remote = self._probe_desc(pool.tensor(PROBE))
        xfer = self._locked(lambda: self._post(pool.agent_name, pool.mem_type, local, remote))
        deadline = time.monotonic() + timeout_s
        while xfer.state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            xfer.state = self._locked(lambda: self._state(xfer))
        with self._lock:
            self._finish(xfer)
        if xfer.state != "DONE":
            why = xfer.error or (f"no completion in {timeout_s:.0f} s" if xfer.state == "PROC" else "ERR")
            raise NixlError(f"cannot write into decode's agent {pool.agent_name}: {why}")

    # ---- the scheduler thread: never blocks ----

    def start(
        self, pages: Sequence[int], slot: int, num_tokens: int,
        writes: Sequence[tuple[NixlTarget, Heads | None]], *, history: bool, full_from: int = 0,
    ) -> list[NixlTransfer] | None:  # fmt: skip
        """Post the request's WRITEs, one per target, all or none (None: the agent is busy, try again):
        full layers from position `full_from` on, into each target's pages (which start there).
        `heads` (tensor parallelism, `shared/transfer/nixl_ranks.py`): which KV heads go, from which of
        ours into which of theirs, and whether the slot's ring_pos row goes too (None: every head, both
        pools whole). Raises ValueError for a target that does not fit decode's pool (nothing posted),
        NixlError when NIXL refuses the first WRITE; one refused after others went out becomes an ERR
        transfer, so that the ones in flight are still waited for."""
        c = self.cache
        plans = []
        for target, heads in writes:
            split = {} if heads is None else dataclasses.asdict(heads)
            plan = write_descs(
                self.pool.by_name, target.pool, c.page_size, c.window, pages, slot, num_tokens,
                target.pages, target.slot, history=history, full_from=full_from, **split,
            )  # fmt: skip
            plans.append((target.pool, plan))
        if not self._lock.acquire(blocking=False):
            return None
        posted: list[NixlTransfer] = []
        try:
            for pool, plan in plans:
                name = pool.agent_name
                if not len(plan.local):
                    posted.append(NixlTransfer(name, None, 0, 0, "DONE"))
                    continue
                try:
                    if name not in self._peers:  # connected before submit, then unloaded: should not happen
                        raise NixlError(f"decode's NIXL agent {name} is not loaded")
                    xfer = self._post(name, pool.mem_type, plan.local, plan.remote)
                except NixlError as e:
                    if not posted:
                        raise
                    posted.append(NixlTransfer(name, None, 0, 0, "ERR", error=str(e)))
                    break
                xfer.full_bytes, xfer.window_bytes = plan.full_bytes, plan.window_bytes
                posted.append(xfer)
        finally:
            self._lock.release()
        return posted

    def poll(self, xfer: NixlTransfer) -> str | None:
        """The WRITE's state, PROC | DONE | ERR (None: the agent is busy). At DONE or ERR the handle is
        released; the caller may then free the pages the WRITE read."""
        if xfer.state != "PROC" or xfer.handle is None:
            return xfer.state
        if not self._lock.acquire(blocking=False):
            return None
        try:
            xfer.state = self._state(xfer)
            if xfer.state != "PROC":
                self._finish(xfer)
            return xfer.state
        finally:
            self._lock.release()

    def abandon(self, xfer: NixlTransfer) -> bool:
        """Cancel a WRITE still running (its lease is long over). True once NIXL has let it go; False:
        busy or not cancellable yet, try again later."""
        if xfer.handle is None:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            xfer.handle.release()  # an active transfer is aborted, or this raises
        except Exception as e:
            xfer.error = f"cannot cancel the WRITE: {e!r}"
            return False
        else:
            xfer.handle, xfer.state = None, "ERR"
            self._busy[xfer.agent_name] -= 1
            return True
        finally:
            self._lock.release()

    # ---- under the lock ----

    def _post(self, name: str, remote_mem: str, local: Any, remote: Any) -> NixlTransfer:
        agent, handle = self.agent, None
        try:
            descs = agent.get_xfer_descs(local, self.pool.mem_type), agent.get_xfer_descs(remote, remote_mem)
            handle = agent.initialize_xfer("WRITE", *descs, name)
            state = agent.transfer(handle)
        except Exception as e:
            if handle is not None:
                self._release(handle)
            raise NixlError(f"WRITE to decode's agent {name} refused: {e!r}") from e
        self._busy[name] += 1
        xfer = NixlTransfer(name, handle, 0, 0, state, started_ns=time.time_ns())
        if state != "PROC":
            self._finish(xfer)
        return xfer

    def _state(self, xfer: NixlTransfer) -> str:
        try:
            return self.agent.check_xfer_state(xfer.handle)
        except Exception as e:  # e.g. the remote agent disconnected
            xfer.error = repr(e)
            return "ERR"

    def _finish(self, xfer: NixlTransfer) -> None:
        if xfer.handle is not None:
            self._release(xfer.handle)
            xfer.handle = None
            self._busy[xfer.agent_name] -= 1
        if xfer.state == "ERR" and not xfer.error:
            xfer.error = "NIXL reported the transfer failed"
        if xfer.state == "ERR":
            self._forget(xfer.agent_name)  # its metadata may be stale (decode restarted): reload next time

    def _release(self, handle: Any) -> None:
        with contextlib.suppress(Exception):  # best effort: NIXL keeps what it cannot free, retries at exit
            handle.release()

    def _forget(self, name: str) -> None:
        if self._busy[name] > 0:
            return
        self._peers.pop(name, None)
        with contextlib.suppress(Exception):  # not loaded, or already gone
            self.agent.remove_remote_agent(name)

    def _evict(self) -> None:
        idle = [n for n in self._peers if self._busy[n] <= 0]
        for name in idle[: max(len(self._peers) - self.max_peers, 0)]:
            self._forget(name)

    def _locked(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return fn()

    @staticmethod
    def _probe_desc(t: Any) -> np.ndarray:
        return np.array([[t.addr, _PROBE_WRITE, t.device_id]], dtype=np.uint64)
