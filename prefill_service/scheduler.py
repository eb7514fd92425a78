"""The prefill scheduler: the shared scheduler loop over an Engine that holds each finished prompt's KV.

Requests run with max_tokens=1 and `hold_kv=True` (chunked prefill under the engine's token budget,
batched with the other prompts). When one finishes, its KV is gathered and copied to host memory in one
go (`shared/transfer/inline.py` `stage`; on CUDA asynchronously, into pinned memory) and its pages
released at once: the prefill pool holds no KV beyond that, so a decode that dies or never reads costs
only the bytes in that stream. The chunks (`Prefilled`) go out once the copy is done, checked by an
event query after each step: the scheduler thread never waits for the device while it has work.
With cuda_ipc the writes into decode's pool are enqueued instead (after decode's ready event;
shared/transfer/cuda_ipc.py) and the pages released at once too: later work on this stream runs after
the writes, so nothing is held for a decode that dies. No write is launched past the request's lease
deadline, which is what lets decode reuse the pages of an abandoned transfer once the lease (plus a
grace) has passed.

Each `Prefilled` also says how many prompt tokens the other live requests still had to compute at that
moment (`queued_tokens`): decode reads it from PrefillDone to estimate this service's queue.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from shared import faults
from shared.engine import Engine
from shared.scheduler_base import Finished, Scheduler, SchedulerConfig, _Entry
from shared.transfer.base import Chunk
from shared.transfer.cuda_ipc import IpcTarget, IpcUnavailable, IpcWriter
from shared.transfer.inline import StagedKV, stage

__all__ = ["PrefillOpts", "PrefillScheduler", "Prefilled"]


@dataclass(frozen=True)
class PrefillOpts:
    window_history: bool = True
    max_chunk_bytes: int = 0  # 0: the backend's default
    cuda_ipc: IpcTarget | None = None  # set: write into decode's pool instead of extracting chunks


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    chunks: tuple[Chunk, ...]
    full_bytes: int
    window_bytes: int
    # Epoch ns stamped on the scheduler thread (telemetry): pages granted, first token read, KV extracted.
    admitted_ns: int = 0
    computed_ns: int = 0
    extracted_ns: int = 0
    queued_tokens: int = 0  # prompt tokens other live requests (waiting + in flight) still had to compute
    cuda_ipc_event: bytes = b""  # cuda_ipc: recorded after the writes into decode's pool (no chunks then)
    # The request could not be handed over (nothing was written): (gRPC status code name, message).
    error: tuple[str, str] | None = None


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

    def ipc_writer(self) -> IpcWriter:
        """The cuda_ipc half of this service (made on first use; raises IpcUnavailable on CPU)."""
        with self._ipc_lock:
            if self._ipc is None:
                self._ipc = IpcWriter(self._engine.cache)
            return self._ipc

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
            staged = stage(
                self._engine.cache, req.pages, req.slot, len(req.prompt), window=opts.window_history
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
        super()._finish(entry, event)

    def _after_step(self) -> None:
        # With nothing else to do, waiting for the copies costs nobody; otherwise only finished ones go.
        self._send_staged(wait=self._engine.idle)

    def _send_staged(self, *, wait: bool) -> None:
        sent = False
        for rid, st in list(self._staging.items()):
            if wait:
                st.staged.wait()
            elif not st.staged.ready():
                continue
            del self._staging[rid]
            chunks = tuple(st.staged.chunks(st.max_chunk_bytes))
            full = sum(c.nbytes for c in chunks if not c.window)
            window = sum(c.nbytes for c in chunks) - full
            st.entry.emit(
                Prefilled(
                    st.first_token, chunks, full, window, st.admitted_ns, st.computed_ns, time.time_ns(),
                    st.queued_tokens,
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
            return Prefilled(first, (), 0, 0, error=("DEADLINE_EXCEEDED", msg))
        try:
            full, window, event = self.ipc_writer().write(
                req.pages, req.slot, len(req.prompt), target, window=opts.window_history
            )
        except IpcUnavailable as e:  # decode's pool cannot be mapped here: nothing was written
            return Prefilled(first, (), 0, 0, error=("FAILED_PRECONDITION", f"cuda_ipc: {e}"))
        except ValueError as e:  # a descriptor that does not fit decode's pool
            return Prefilled(first, (), 0, 0, error=("INVALID_ARGUMENT", f"cuda_ipc target: {e}"))
        return Prefilled(
            first, (), full, window, req.admitted_ns, computed_ns, time.time_ns(),
            self._queued_tokens(entry), cuda_ipc_event=event,
        )  # fmt: skip
