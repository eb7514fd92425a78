"""Prefill's nixl WRITEs in flight (prefill_service/nixl_sends.py) against a scripted writer, no NIXL:
the pages are held until the WRITE has ended, whatever happens meanwhile, and each ending is one
Prefilled (or, for a cancelled call, none) and one Finished."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from prefill_service.nixl_sends import NixlSends
from shared.engine.sampling import SamplingParams
from shared.serving.scheduler_base import Finished, _Entry
from shared.transfer.nixl import NixlError, NixlPool, NixlTarget
from shared.transfer.nixl_writer import NixlTransfer

POOL = NixlPool("decode-1", b"", "DRAM", ())


class _Writer:
    """Answers `start` and `poll` from scripts; None is "the agent is busy"."""

    def __init__(self, starts: list[Any], polls: list[str | None], abandons: bool = True) -> None:
        self.starts, self.polls, self.abandons = starts, polls, abandons
        self.abandoned = 0

    def start(self, *args: Any, **kw: Any) -> list[NixlTransfer] | None:
        what = self.starts.pop(0)
        if isinstance(what, Exception):
            raise what
        return [NixlTransfer("decode-1", object(), 100, 20, "PROC")] if what == "PROC" else None

    def poll(self, xfer: NixlTransfer) -> str | None:
        state = self.polls.pop(0) if self.polls else "PROC"
        if state == "ERR":
            xfer.error = "remote disconnected"
        if state is not None:  # as NixlWriter.poll: the transfer's state follows
            xfer.state = state
        return state

    def abandon(self, xfer: NixlTransfer) -> bool:
        self.abandoned += 1
        if self.abandons:  # as NixlWriter.abandon: a transfer let go has ended, in error
            xfer.state = "ERR"
        return self.abandons


class _Harness:
    def __init__(self, writer: _Writer, lease_s: float = 30.0) -> None:
        self.released: list[Any] = []
        self.events: list[Any] = []
        self.finished: list[Finished] = []
        model = SimpleNamespace(tp=None, whole_kv_heads=2)  # one rank: one WRITE of every head
        engine = SimpleNamespace(release=self.released.append, runner=SimpleNamespace(model=model))
        self.sends = NixlSends(engine, lambda: writer, self._prefilled, self._finish)  # type: ignore[arg-type]
        self.req = SimpleNamespace(pages=[3, 4], slot=1, prompt=[1, 2, 3, 4, 5], output=[42], admitted_ns=1)
        self.entry = _Entry("r1", [1, 2, 3, 4, 5], SamplingParams(), self.events.append, req=self.req)  # type: ignore[arg-type]
        target = NixlTarget(POOL, (7, 8), 0, time.time_ns() + int(lease_s * 1e9))
        self.sends.begin(self.entry, target, True, 5, 0)
        assert self.sends.hold(self.entry, Finished("length", 5, 1))  # what the scheduler does next

    def _prefilled(self, entry: _Entry, first: int, full: int, window: int, *rest: Any) -> Any:
        return ("prefilled", first, full, window, rest[-1])

    def _finish(self, entry: _Entry, event: Finished) -> None:
        self.finished.append(event)

    def poll(self, times: int = 1) -> None:
        for _ in range(times):
            self.sends.poll()


def test_the_pages_are_held_until_done_then_prefilled_then_finished():
    h = _Harness(_Writer(["PROC"], ["PROC", None, "PROC", "DONE"]))
    h.poll(3)
    assert h.sends.pending and not h.released and not h.events
    h.poll()
    assert h.released == [h.req] and h.events == [("prefilled", 42, 100, 20, None)]
    assert [f.reason for f in h.finished] == ["length"] and not h.sends.pending


def test_a_busy_agent_is_retried_on_the_next_iteration():
    h = _Harness(_Writer([None, "PROC"], ["DONE"]))
    h.poll()
    assert h.sends.pending and not h.released
    h.poll()
    assert h.released and h.events[0][0] == "prefilled"


def test_a_failed_write_releases_the_pages_and_fails_unavailable():
    h = _Harness(_Writer(["PROC"], ["PROC", "ERR"]))
    h.poll(2)
    assert h.released == [h.req]
    code, msg = h.events[0][-1]
    assert code == "UNAVAILABLE" and "decode-1" in msg and "remote disconnected" in msg
    h2 = _Harness(_Writer([NixlError("refused")], []))
    h2.poll()
    assert h2.released and h2.events[0][-1] == ("UNAVAILABLE", "nixl: refused")
    h3 = _Harness(_Writer([ValueError("destination page outside decode's pool")], []))
    h3.poll()
    assert h3.released and h3.events[0][-1][0] == "INVALID_ARGUMENT"


def test_a_cancelled_call_keeps_the_pages_until_the_write_has_ended():
    h = _Harness(_Writer(["PROC"], ["PROC", "PROC", "DONE"]))
    h.poll()
    assert h.sends.cancel("r1") and not h.sends.cancel("other")
    h.poll()
    assert not h.released  # UCX may still be reading them
    h.poll()
    assert h.released == [h.req] and not h.events  # nobody is listening
    assert [f.reason for f in h.finished] == ["abort"]


def test_no_write_starts_after_the_lease_and_one_running_past_it_is_cancelled(monkeypatch):
    h = _Harness(_Writer(["PROC"], []), lease_s=-1.0)
    h.poll()
    assert h.released and h.events[0][-1][0] == "DEADLINE_EXCEEDED"
    monkeypatch.setattr("prefill_service.nixl_sends.ABANDON_AFTER_LEASE_S", 0.0)
    writer = _Writer(["PROC"], [], abandons=False)
    h2 = _Harness(writer, lease_s=0.05)
    h2.poll()  # started within the lease
    time.sleep(0.06)
    h2.poll(2)  # past it: cancelling is tried, and until NIXL lets go the pages stay
    assert writer.abandoned == 2 and not h2.released
    writer.abandons = True
    h2.poll()
    assert h2.released and h2.events[0][-1][0] == "DEADLINE_EXCEEDED"
