"""The prefill scheduler: the shared scheduler loop over an Engine that holds each finished prompt's KV.

Requests run with max_tokens=1 and `hold_kv=True` (chunked prefill under the engine's token budget,
batched with the other prompts). When one finishes, its KV is extracted here, on the scheduler thread,
as CPU bytes (`Prefilled`), and released at once: the prefill pool holds no KV beyond extraction, so a
decode that dies or never reads costs only the bytes in that stream. (A zero-copy backend, cuda_ipc or
nixl, cannot release before the decode has read: it will need a lease with a timeout instead.)

Each `Prefilled` also says how many prompt tokens the other live requests still had to compute at that
moment (`queued_tokens`): decode reads it from PrefillDone to estimate this service's queue.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from shared import faults
from shared.engine import Engine
from shared.scheduler_base import Scheduler, SchedulerConfig, _Entry
from shared.transfer.base import Chunk
from shared.transfer.inline import extract_chunks

__all__ = ["PrefillOpts", "PrefillScheduler", "Prefilled"]


@dataclass(frozen=True)
class PrefillOpts:
    window_history: bool = True
    max_chunk_bytes: int = 0  # 0: the backend's default


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


class PrefillScheduler(Scheduler):
    thread_name = "prefill-scheduler"

    def __init__(self, engine: Engine, cfg: SchedulerConfig | None = None) -> None:
        super().__init__(engine, cfg)
        self.faults = faults.from_env()  # PDSERVE_TEST_FAULTS: tests only

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
            chunks = tuple(
                extract_chunks(
                    self._engine.cache, req.pages, req.slot, len(req.prompt),
                    window=opts.window_history, max_chunk_bytes=opts.max_chunk_bytes,
                )
            )  # fmt: skip
            full = sum(c.nbytes for c in chunks if not c.window)
            window = sum(c.nbytes for c in chunks) - full
            entry.emit(
                Prefilled(
                    req.output[0], chunks, full, window, req.admitted_ns, computed_ns, time.time_ns(),
                    self._queued_tokens(entry),
                )
            )  # fmt: skip
        self._engine.release(req)  # idempotent; deferred by the engine while a step may still write
