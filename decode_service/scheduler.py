"""The decode scheduler: the shared scheduler loop plus the remote-prefill path.

A remote request (submitted with `RemoteOpts`) is not added to the engine's waiting queue. The
scheduler thread reserves pages and a window for it (`Engine.reserve`; it waits in `_pending` while
the pool is full, retried after every step) and emits `Reserved`. The servicer then calls the prefill
service; every KV chunk it receives comes back here through `deliver` and is written into the
reservation on this thread (the engine and its cache are not thread-safe), and `prefilled` admits the
request into continuous batching. An abort at any point releases the reservation exactly once; chunks
that arrive for a released request are dropped. `prefill_locally` turns a reserved request into a local
one (the prefill service refused decode's KV layout, or did not answer in time): the client still gets
a normal completion.

With a prefix cache the reservation shares the cached pages of the prompt's longest cached prefix
(`Engine.reserve(share=True)`): `Reserved.cached_tokens` of the prompt are in shared pages nobody may
write, and only the KV after them is asked of prefill. A full-layer batch for a position before that is
refused (`apply_batch`), and the pages a zero-copy backend may write are the reservation's from there on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from shared.engine.engine import Engine, Pending
from shared.engine.request import Request
from shared.serving import faults
from shared.serving.scheduler_base import (
    AlreadyExists,
    Event,
    Finished,
    NotAccepting,
    PoolState,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    SubmitError,
    Tokens,
    _Entry,
)
from shared.transfer import ipc_ranks
from shared.transfer.cuda_ipc import IpcReceiver
from shared.transfer.inline import KVBatch
from shared.transfer.nixl import NixlReceiver
from shared.transfer.ranks import apply_batch_all, begin_receive_all

__all__ = [
    "AlreadyExists",
    "DecodeScheduler",
    "Event",
    "Finished",
    "NotAccepting",
    "PoolState",
    "QueueFull",
    "RemoteOpts",
    "Reserved",
    "Scheduler",
    "SchedulerConfig",
    "SubmitError",
    "Tokens",
]


# After a cuda_ipc or nixl lease ends, how long a write prefill launched just before it may still take to
# land: cuda_ipc's runs behind at most the prefill steps already queued on prefill's stream (milliseconds
# each); prefill cancels a nixl WRITE still running ABANDON_AFTER_LEASE_S (2 s) after the lease.
WRITE_GRACE_S = 5.0


@dataclass(frozen=True)
class RemoteOpts:
    """Prefill this request on the prefill service."""

    window_history: bool = True


@dataclass(frozen=True)
class Reserved:
    """Pages and a window are reserved: the KV may now be transferred in."""

    at_ns: int = 0  # when (epoch ns): the request's queue time ends here
    pages: tuple[int, ...] = ()
    slot: int = 0
    ready_event: bytes = b""  # cuda_ipc: recorded once the reservation's own writes are enqueued
    # Prompt tokens whose full-layer KV the reservation reads from the prefix cache: `pages` up to
    # cached_tokens // page_size are shared (read-only); prefill ships the KV from here on.
    cached_tokens: int = 0
    # nixl on CUDA, and cuda_ipc with ranks: `_Settled`, whether the reservation's own writes (its
    # rings emptied) have run on every rank's GPU. Query it before sending the target: UCX writes
    # outside the streams' order, and a cuda_ipc write into rank j > 0 waits on no event of rank j's,
    # so an emptying still queued could land after prefill's ring_pos.
    settled: Any = None


_SETTLE_POLL_S = 0.0002  # how often an otherwise idle loop collects the other ranks' emptying


@dataclass
class _Settled:
    """`Reserved.settled` (nixl on CUDA, cuda_ipc with ranks): the reservation's emptying has run on
    every rank's GPU (this rank's event; the others' collected on the scheduler thread, which sets
    `others`)."""

    event: torch.cuda.Event
    others: threading.Event = dataclasses.field(default_factory=threading.Event)

    def query(self) -> bool:
        return self.others.is_set() and self.event.query()


class DecodeScheduler(Scheduler):
    thread_name = "decode-scheduler"

    def __init__(
        self, engine: Engine, cfg: SchedulerConfig | None = None, ipc: IpcReceiver | None = None,
        nixl: NixlReceiver | None = None,
    ) -> None:  # fmt: skip
        super().__init__(engine, cfg)
        self._pending: deque[_Entry] = deque()  # remote requests waiting for room; scheduler thread only
        self._reserved: dict[str, _Entry] = {}  # reserved, KV in transfer; scheduler thread only
        self.faults = faults.from_env()  # PDSERVE_TEST_FAULTS: tests only
        self.ipc = ipc  # cuda_ipc: prefill writes into this pool
        self.nixl = nixl  # nixl: prefill writes into this pool (its agent lives as long as this)
        self._leases: dict[str, int] = {}  # rid -> cuda_ipc / nixl write lease deadline (epoch ns)
        # nixl on CUDA with ranks: the other ranks' emptying of a reservation, until each has run
        self._settling: list[tuple[Pending, threading.Event]] = []
        self._quarantined: dict[str, Request] = {}  # abandoned zero-copy reservations, freed at lease end

    # ---- any thread ----

    def deliver(self, rid: str, batches: list[KVBatch]) -> None:
        """KV for a reserved request, in order (dropped if it was aborted meanwhile)."""
        self._post(lambda: self._apply_batches(rid, batches))

    def prefilled(
        self, rid: str, first_token: int, history: bool, cuda_ipc_events: tuple[bytes, ...] = ()
    ) -> None:  # fmt: skip
        """Every chunk has been delivered (or, cuda_ipc, the writes' events have come: one a prefill
        rank): admit the request."""
        self._post(lambda: self._admit(rid, first_token, history, cuda_ipc_events))

    def leased(self, rid: str, deadline_ns: int) -> None:
        """Prefill may write into this reservation until `deadline_ns` (cuda_ipc, nixl): call before
        sending.

        An abort before the writes are known done then keeps the pages until the lease and a grace have
        passed, so a late write never lands in pages another request holds.
        """
        self._post(lambda: self._leases.__setitem__(rid, deadline_ns) if rid in self._reserved else None)

    def prefill_locally(self, rid: str, *, written: bool = False) -> None:
        """No KV is coming for this reserved request: compute its prompt here instead. `written`: the
        remote prefill may still write into the reservation (a cuda_ipc or nixl call that timed out),
        so its pages stay quarantined until the lease has passed and the prompt gets fresh ones."""
        self._post(lambda: self._local(rid, written))

    # ---- the scheduler thread ----

    def _start(self, entry: _Entry) -> None:
        if not isinstance(entry.opts, RemoteOpts):
            super()._start(entry)
            return
        self._pending.append(entry)
        self._reserve_pending()

    def _reserve_pending(self) -> None:
        while self._pending:
            entry = self._pending[0]
            # ValueError: refused, as add_request. share: a no-op without a prefix cache.
            req = self._engine.reserve(entry.prompt, entry.params, share=True)
            if req is None:
                return  # no room yet: retried after the next step frees pages
            self._pending.popleft()
            entry.req = req
            emptied = begin_receive_all(self._engine, req)
            self._reserved[entry.rid] = entry
            ready = self.ipc.ready() if self.ipc is not None else b""
            settled = None
            # nixl writes outside the streams' order; cuda_ipc with ranks orders prefill's writes after
            # rank 0's event only: either way every rank's emptying must have run before the target goes
            ranked = self.ipc is not None and self._engine.runner.model.tp is not None
            if (self.nixl is not None or ranked) and self._engine.cache.device.type == "cuda":
                settled = _Settled(torch.cuda.Event())
                settled.event.record(torch.cuda.current_stream(self._engine.cache.device))
                if self._engine.collect(emptied):
                    settled.others.set()
                else:  # the other ranks' emptying, collected on this thread as it completes
                    self._settling.append((emptied, settled.others))
            entry.emit(
                Reserved(req.admitted_ns, tuple(req.pages), req.slot, ready, req.cached_tokens, settled)
            )

    def _poll_interval(self) -> float | None:
        return _SETTLE_POLL_S if self._settling else None

    def _after_step(self) -> None:
        if self._settling:
            self._settling = [(p, flag) for p, flag in self._settling if not self._collected(p, flag)]
        if self._pending:
            try:
                self._reserve_pending()
            except ValueError as exc:
                entry = self._pending.popleft()
                self._finish(entry, Finished("abort", len(entry.prompt), 0, error=str(exc)))

    def _collected(self, pending: Pending, flag: threading.Event) -> bool:
        if self._engine.collect(pending):
            flag.set()
            return True
        return False

    def _abort_one(self, rid: str) -> None:
        for entry in self._pending:
            if entry.rid == rid:
                self._pending.remove(entry)
                self._finish(entry, Finished("abort", len(entry.prompt), 0))
                return
        if rid in self._reserved:
            self._drop_reserved(rid)
            return
        super()._abort_one(rid)

    def _drop_reserved(self, rid: str, error: str | None = None) -> None:
        """End a reserved request: its pages are freed now, or, while prefill may still write into
        them (a lease), only once the lease and the grace have passed."""
        entry = self._reserved.pop(rid)
        assert entry.req is not None
        lease = self._leases.pop(rid, None)
        if lease is None:
            self._engine.release(entry.req)
        else:
            self._quarantine(rid, entry.req, lease)
        self._finish(entry, Finished("abort", len(entry.prompt), 0, error=error))

    def _quarantine(self, rid: str, req: Request, lease_ns: int) -> None:
        """Hold an abandoned zero-copy reservation until no write of prefill's can still land in it."""
        self._quarantined[rid] = req
        delay = max(lease_ns - time.time_ns(), 0) / 1e9 + WRITE_GRACE_S
        timer = threading.Timer(delay, lambda: self._post(lambda: self._unquarantine(rid)))
        timer.daemon = True
        timer.start()

    def _unquarantine(self, rid: str) -> None:
        req = self._quarantined.pop(rid, None)
        if req is not None:
            self._engine.release(req)  # the loop publishes the pool state after this

    def _apply_batches(self, rid: str, batches: list[KVBatch]) -> None:
        entry = self._reserved.get(rid)
        if entry is None:
            return  # aborted while the bytes were on their way
        req = entry.req
        assert req is not None
        try:
            for batch in batches:
                apply_batch_all(self._engine, req, batch)
        except (ValueError, RuntimeError) as exc:  # a malformed batch costs this request only
            self._drop_reserved(rid, f"bad KV chunk: {exc}")

    def _admit(self, rid: str, first_token: int, history: bool, cuda_ipc_events: tuple[bytes, ...]) -> None:
        if rid not in self._reserved:
            return
        if cuda_ipc_events:
            try:
                if self.ipc is None:
                    raise RuntimeError("this decode did not ask for cuda_ipc")
                # every rank's next step runs after prefill's writes (every prefill rank's)
                ipc_ranks.wait_all(self._engine, self.ipc, cuda_ipc_events)
            except RuntimeError as exc:  # no event to order the reads after: this request cannot run
                self._drop_reserved(rid, f"prefill's cuda_ipc event does not open here: {exc}")
                return
        entry = self._reserved.pop(rid)
        assert entry.req is not None
        self._leases.pop(rid, None)  # the writes are done
        if not history:
            self._engine.flush()  # bounded replay runs alone, not beside a step in flight
        self._engine.admit_prefilled(entry.req, first_token, history=history)
        self._active[rid] = entry

    def _local(self, rid: str, written: bool) -> None:
        entry = self._reserved.pop(rid, None)
        if entry is None:
            return  # aborted meanwhile
        assert entry.req is not None
        lease = self._leases.pop(rid, None)
        # The engine has no public reserved -> prefill step, so the reservation goes back and the request
        # queues as any local one; in this same iteration, so the pages it freed are there for it unless a
        # request queued before it takes them (then it waits its turn: delayed, never lost).
        if written and lease is not None:
            self._quarantine(rid, entry.req, lease)  # a late write must not land in another's pages
        else:
            self._engine.release(entry.req)  # refused before any work, or inline: nothing writes there
        entry.opts = None
        super()._start(entry)  # ValueError cannot happen: reserve() accepted the same prompt and params
