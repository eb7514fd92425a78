"""The prefill scheduler: the shared scheduler loop over an Engine that holds each finished prompt's KV.

Requests run with max_tokens=1 and `hold_kv=True` (chunked prefill under the engine's token budget,
batched with the other prompts). When one finishes, its KV is gathered and copied to host memory in one
go (`shared/transfer/inline.py` `stage`; on CUDA asynchronously, into pinned memory) and its pages
released at once: the prefill pool holds no KV beyond that, so a decode that dies or never reads costs
only the bytes in that stream. `Prefilled` goes out once the copy is done, checked by an event query on
each loop iteration (an idle loop comes round every POLL_S): the scheduler thread never waits for the
device, and never copies the bytes into messages either (the servicer does, chunk by chunk).
With cuda_ipc the writes into decode's pool are enqueued instead (after decode's ready event;
shared/transfer/cuda_ipc.py) and the pages released at once too: later work on this stream runs after
the writes, so nothing is held for a decode that dies. No write is launched past the request's lease
deadline, which is what lets decode reuse the pages of an abandoned transfer once the lease (plus a
grace) has passed. With nixl one WRITE into decode's pool is started and polled instead, and the pages
are held until it is done (prefill_service/nixl_sends.py): PrefillDone then means the KV is there.

Each `Prefilled` also says how many prompt tokens the other live requests still had to compute at that
moment (`queued_tokens`): decode reads it from PrefillDone to estimate this service's queue.

Decode's prefix cache may hold the prompt's first positions already (`PrefillOpts.full_from`, from
PrefillRequest.cached_tokens): every backend then ships the full layers' KV from there on only (the
sliding layers' window as ever), and `Prefilled` says where it started and how much of the prompt this
service read from its own prefix cache.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from prefill_service.nixl_sends import POLL_S, NixlSends
from shared.engine.engine import Engine
from shared.serving import faults
from shared.serving.scheduler_base import Finished, Scheduler, SchedulerConfig, _Entry
from shared.transfer import ipc_ranks
from shared.transfer.cuda_ipc import IpcTarget, IpcUnavailable, IpcWriter, PoolExport
from shared.transfer.inline import StagedKV
from shared.transfer.nixl import NixlTarget
from shared.transfer.nixl_writer import NixlWriter
from shared.transfer.ranks import own_heads, stage_all

__all__ = ["PrefillOpts", "PrefillScheduler", "Prefilled"]


@dataclass(frozen=True)
class PrefillOpts:
    window_history: bool = True
    max_chunk_bytes: int = 0  # 0: the backend's default
    cuda_ipc: IpcTarget | None = None  # set: write into decode's pool instead of extracting chunks
    nixl: NixlTarget | None = None  # set: one NIXL WRITE into decode's pool instead of chunks
    full_from: int = 0  # decode holds the full layers' KV of positions [0, full_from): ship from there


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    staged: StagedKV | None  # inline: the KV in host memory, copy done; the servicer streams its chunks
    full_bytes: int
    window_bytes: int
    max_chunk_bytes: int = 0  # inline: the chunk size decode asked for (0: the default)
    # Epoch ns stamped on the scheduler thread (telemetry): pages granted, first token read, KV extracted.
    admitted_ns: int = 0
    computed_ns: int = 0
    extracted_ns: int = 0
    queued_tokens: int = 0  # prompt tokens other live requests (waiting + in flight) still had to compute
    cuda_ipc_event: bytes = b""  # cuda_ipc: recorded after the writes into decode's pool (no chunks then)
    cuda_ipc_rank_events: tuple[bytes, ...] = ()  # cuda_ipc with ranks: the other ranks' events
    # The request could not be handed over (nothing was written): (gRPC status code name, message).
    error: tuple[str, str] | None = None
    full_from: int = 0  # the first position of the full layers' KV shipped
    hit_tokens: int = 0  # prompt tokens read from this service's prefix cache (not computed)


@dataclass
class _Staging:
    """A finished prompt whose KV is on its way to host memory (inline): sent once the copy is done."""

    entry: _Entry
    staged: StagedKV
    max_chunk_bytes: int
    first_token: int
    admitted_ns: int
    computed_ns: int
    queued_tokens: int
    finished: Finished | None = None  # the scheduler's Finished, held back until Prefilled is out


class PrefillScheduler(Scheduler):
    thread_name = "prefill-scheduler"

    def __init__(self, engine: Engine, cfg: SchedulerConfig | None = None) -> None:
        super().__init__(engine, cfg)
        self.faults = faults.from_env()  # PDSERVE_TEST_FAULTS: tests only
        self._staging: dict[str, _Staging] = {}  # rid -> inline KV being copied out; scheduler thread
        self._ipc: IpcWriter | None = None
        self._ipc_lock = threading.Lock()
        self._nixl: NixlWriter | None = None  # made on first use: importing NIXL only when chosen
        self._nixl_sends = NixlSends(engine, self.nixl_writer, self._nixl_prefilled, self._finish)

    def ipc_writer(self) -> IpcWriter:
        """The cuda_ipc half of this service (made on first use; raises IpcUnavailable on CPU)."""
        with self._ipc_lock:
            if self._ipc is None:
                self._ipc = IpcWriter(self._engine.cache)
            return self._ipc

    def map_ipc(self, export: PoolExport) -> None:
        """Map decode's pools this rank writes into (any thread; raises IpcUnavailable)."""
        ipc_ranks.map_own(self._engine, self.ipc_writer(), export)

    def ipc_mapped(self, export: PoolExport) -> bool:
        """Whether `map_ipc(export)` has nothing left to map (never makes the writer)."""
        return self._ipc is not None and ipc_ranks.mapped_own(self._engine, self._ipc, export)

    def nixl_writer(self) -> NixlWriter:
        """The nixl half of this service (made on first use; raises NixlUnavailable without NIXL)."""
        with self._ipc_lock:
            if self._nixl is None:
                self._nixl = NixlWriter(self._engine.cache, heads=own_heads(self._engine))
            return self._nixl

    def made_nixl_writer(self) -> NixlWriter | None:
        """The nixl half if it exists already (never makes it: that may take a while)."""
        return self._nixl

    def _queued_tokens(self, done: _Entry) -> int:
        """Prompt tokens not yet computed over every live request but `done` (scheduler thread)."""
        with self._cond:  # _live also changes under submit, on other threads
            entries = [e for e in self._live.values() if e is not done]
        # entry.req is written only on this thread; None: still in the inbox, nothing computed.
        return sum(max(len(e.prompt) - (e.req.num_computed if e.req is not None else 0), 0) for e in entries)

    def _start(self, entry: _Entry) -> None:
        params = dataclasses.replace(entry.params, max_tokens=1)
        entry.req = self._engine.add_request(entry.prompt, params, hold_kv=True)
        self._active[entry.rid] = entry

    def _on_done(self, entry: _Entry) -> None:
        req = entry.req
        assert req is not None
        if req.finish_reason != "abort" and req.output:
            computed_ns = time.time_ns()
            opts = entry.opts if isinstance(entry.opts, PrefillOpts) else PrefillOpts()
            if opts.cuda_ipc is not None:
                entry.emit(self._write_ipc(entry, opts, computed_ns))
                self._engine.release(req)  # at once: later work on this stream runs after the writes
                return
            if opts.nixl is not None:  # the WRITE reads the pages: released once it has ended
                queued, history = self._queued_tokens(entry), opts.window_history
                self._nixl_sends.begin(entry, opts.nixl, history, computed_ns, queued, opts.full_from)
                return
            staged = stage_all(
                self._engine, req, len(req.prompt), window=opts.window_history, full_from=opts.full_from
            )
            self._staging[entry.rid] = _Staging(
                entry, staged, opts.max_chunk_bytes, req.output[0], req.admitted_ns, computed_ns,
                self._queued_tokens(entry),
            )  # fmt: skip
        self._engine.release(req)  # idempotent; deferred by the engine while a step may still write

    def _finish(self, entry: _Entry, event: Finished) -> None:
        st = self._staging.get(entry.rid)
        if st is not None and st.finished is None:
            st.finished = event  # after its Prefilled: the servicer must see the bytes first
            return
        if self._nixl_sends.hold(entry, event):  # likewise, after its WRITE
            return
        super()._finish(entry, event)

    def _after_step(self) -> None:
        self._send_staged()
        if self._nixl_sends.pending and self._nixl_sends.poll():
            self._publish()

    def _poll_interval(self) -> float | None:
        # Copies out (inline) or WRITEs (nixl) in flight: come round to poll them, never wait on them.
        return POLL_S if self._staging or self._nixl_sends.pending else None

    def _abort_one(self, rid: str) -> None:
        if not self._nixl_sends.cancel(rid):  # a WRITE in flight ends first: its pages are read
            super()._abort_one(rid)

    def _nixl_prefilled(
        self, entry: _Entry, first: int, full: int, window: int, computed_ns: int, queued: int,
        error: tuple[str, str] | None,
    ) -> Prefilled:  # fmt: skip
        req = entry.req
        assert req is not None
        if error is not None:
            return Prefilled(first, None, 0, 0, error=error)
        opts = entry.opts if isinstance(entry.opts, PrefillOpts) else PrefillOpts()
        return Prefilled(
            first, None, full, window, 0, req.admitted_ns, computed_ns, time.time_ns(), queued,
            full_from=opts.full_from, hit_tokens=req.cached_tokens,
        )  # fmt: skip

    def _send_staged(self) -> None:
        sent = False
        for rid, st in list(self._staging.items()):
            if not st.staged.ready():
                continue
            del self._staging[rid]
            full, window = st.staged.nbytes()
            # The bytes are copied into messages by the servicer, not here: a 4k-token prompt is
            # hundreds of MB, and this thread schedules everyone else's prompts.
            hit = st.entry.req.cached_tokens if st.entry.req is not None else 0
            st.entry.emit(
                Prefilled(
                    st.first_token, st.staged, full, window, st.max_chunk_bytes, st.admitted_ns,
                    st.computed_ns, time.time_ns(), st.queued_tokens, full_from=st.staged.full_from,
                    hit_tokens=hit,
                )
            )  # fmt: skip
            if st.finished is not None:
                super()._finish(st.entry, st.finished)
            sent = True
        if sent:
            self._publish()  # the pool state counted these as live

    def _write_ipc(self, entry: _Entry, opts: PrefillOpts, computed_ns: int) -> Prefilled:
        req, target = entry.req, opts.cuda_ipc
        assert req is not None and target is not None
        first = req.output[0]
        if time.time_ns() >= target.lease_deadline_ns:  # decode may already be reusing those pages
            msg = "the cuda_ipc write lease expired before the prompt was computed"
            return Prefilled(first, None, 0, 0, error=("DEADLINE_EXCEEDED", msg))
        try:
            full, window, event, rank_events = ipc_ranks.write_all(
                self._engine, self.ipc_writer(), req, target, window=opts.window_history,
                full_from=opts.full_from,
            )  # fmt: skip
        except IpcUnavailable as e:  # decode's pool cannot be mapped here: nothing was written
            return Prefilled(first, None, 0, 0, error=("FAILED_PRECONDITION", f"cuda_ipc: {e}"))
        except ValueError as e:  # a descriptor that does not fit decode's pool
            return Prefilled(first, None, 0, 0, error=("INVALID_ARGUMENT", f"cuda_ipc target: {e}"))
        return Prefilled(
            first, None, full, window, 0, req.admitted_ns, computed_ns, time.time_ns(),
            self._queued_tokens(entry), cuda_ipc_event=event, cuda_ipc_rank_events=rank_events,
            full_from=opts.full_from,
            hit_tokens=req.cached_tokens,
        )  # fmt: skip
