"""Prefill's nixl WRITEs in flight, on the scheduler thread (shared/transfer/nixl_writer.py does the NIXL
calls).

A prompt done with a nixl target keeps its pages (the WRITE reads them) and its place among the live
requests: its Finished is held back. The WRITE is started on that same loop iteration and its state
checked on every later one (`poll`, after each step; the loop wakes for it while idle), never waited on.
At DONE the pages are released and `Prefilled` goes out: the KV is then in decode's memory, so
PrefillDone means decode can read it. At ERR the pages are released and the request fails UNAVAILABLE.
No WRITE is started past the lease (decode may then reuse those pages); one still running
ABANDON_AFTER_LEASE_S after it is cancelled. A request aborted meanwhile (the call was cancelled) keeps
its pages until its WRITE has ended too, then goes quietly. Where either side has tensor-parallel
ranks, a request's WRITE is every rank's (shared/transfer/nixl_ranks.py): it has ended once each
rank's has.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.engine.engine import Engine
from shared.serving.scheduler_base import Finished, _Entry
from shared.transfer import nixl_ranks
from shared.transfer.nixl import ABANDON_AFTER_LEASE_S, NixlError, NixlTarget
from shared.transfer.nixl_writer import NixlWriter

__all__ = ["NixlSends"]

POLL_S = 0.0005  # how often an otherwise idle loop checks the WRITEs in flight


@dataclass
class _Send:
    entry: _Entry
    target: NixlTarget
    history: bool
    computed_ns: int
    queued_tokens: int
    full_from: int = 0  # full layers from this position on (decode holds the ones before)
    xfer: nixl_ranks.Send | None = None  # None: not started yet (the agent was busy)
    cancelled: bool = False
    finished: Finished | None = None  # the scheduler's Finished, held back until the send ends


class NixlSends:
    """`make_prefilled(entry, first_token, full, window, computed_ns, queued, error)` builds the event
    the servicer waits for; `finish(entry, event)` ends a request as the scheduler does."""

    def __init__(
        self, engine: Engine, writer: Callable[[], NixlWriter], make_prefilled: Callable[..., Any],
        finish: Callable[[_Entry, Finished], None],
    ) -> None:  # fmt: skip
        self._engine, self._writer = engine, writer
        self._make_prefilled, self._finish = make_prefilled, finish
        self._sends: dict[str, _Send] = {}

    @property
    def pending(self) -> bool:
        return bool(self._sends)

    def begin(
        self, entry: _Entry, target: NixlTarget, history: bool, computed_ns: int, queued: int,
        full_from: int = 0,
    ) -> None:  # fmt: skip
        """A prompt is done: hold its pages and Finished, start its WRITE (at the next `poll`); full
        layers from position `full_from` on."""
        self._sends[entry.rid] = _Send(entry, target, history, computed_ns, queued, full_from)

    def hold(self, entry: _Entry, event: Finished) -> bool:
        """Keep `event` back while the request's WRITE runs (True: held)."""
        send = self._sends.get(entry.rid)
        if send is None or send.finished is not None:
            return False
        send.finished = event
        return True

    def cancel(self, rid: str) -> bool:
        """The call went away: end quietly once nothing reads the pages any more (False: not ours)."""
        send = self._sends.get(rid)
        if send is None:
            return False
        send.cancelled = True
        return True

    def poll(self) -> bool:
        """Start and check the WRITEs; True when some request ended (its pages are back)."""
        now, ended = time.time_ns(), False
        for rid, send in list(self._sends.items()):
            outcome = self._step(send, now)
            if outcome is not None:
                del self._sends[rid]
                self._end(send, *outcome)
                ended = True
        return ended

    def _step(self, send: _Send, now: int) -> tuple[str, str] | None:
        """Advance one send; (status code name, message) once it has ended ("OK", "" for success)."""
        lease = send.target.lease_deadline_ns
        if send.xfer is None:
            if send.cancelled:
                return "CANCELLED", ""
            if now >= lease:  # decode may already be reusing those pages
                return "DEADLINE_EXCEEDED", "nixl: the write lease expired before the prompt was computed"
            req = send.entry.req
            assert req is not None
            try:
                send.xfer = nixl_ranks.start(
                    self._engine, self._writer(), req, send.target, history=send.history,
                    full_from=send.full_from,
                )  # fmt: skip
            except ValueError as e:  # a target that does not fit decode's pool: nothing was written
                return "INVALID_ARGUMENT", f"nixl target: {e}"
            except NixlError as e:
                return "UNAVAILABLE", f"nixl: {e}"
            if send.xfer is None:
                return None  # the agent was busy (a handshake): next iteration
        state = send.xfer.poll()
        if state == "DONE":
            return "OK", ""
        if state == "ERR":
            msg = f"nixl: the KV write into decode's pool ({send.xfer.agent_name}) failed: {send.xfer.error}"
            return "UNAVAILABLE", msg
        if now > lease + ABANDON_AFTER_LEASE_S * 1e9 and send.xfer.abandon():
            return "DEADLINE_EXCEEDED", "nixl: the KV write did not complete within its lease (cancelled)"
        return None

    def _end(self, send: _Send, code: str, msg: str) -> None:
        entry, req = send.entry, send.entry.req
        assert req is not None
        self._engine.release(req)  # nothing reads the pages any more
        if not send.cancelled:
            xfer, error = send.xfer, None if code == "OK" else (code, msg)
            full, window = (xfer.full_bytes, xfer.window_bytes) if xfer is not None and not error else (0, 0)
            entry.emit(self._make_prefilled(entry, req.output[0], full, window, send.computed_ns,
                                            send.queued_tokens, error))  # fmt: skip
        event = send.finished
        if send.cancelled or event is None:
            event = Finished("abort", len(entry.prompt), len(req.output))
        self._finish(entry, event)
