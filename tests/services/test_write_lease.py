"""Decode's side of a zero-copy transfer's lease (cuda_ipc, nixl), on a real DecodeScheduler and Engine.

Once decode has told the scheduler that prefill may write into a reservation until a deadline
(`leased`), an abort must not hand those pages to anyone else before the deadline plus the write grace
has passed: a late write would land in another request's KV. Without a lease, and once the writes are
known done, pages come back at once.
"""

from __future__ import annotations

import queue
import time

import pytest

from decode_service import scheduler as decode_scheduler
from decode_service.scheduler import DecodeScheduler, Finished, RemoteOpts, Reserved, SchedulerConfig
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def sched(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(decode_scheduler, "WRITE_GRACE_S", 0.3)
    engine = Engine(
        tiny_model(tiny_config()), KVConfig(page_size=4, num_pages=64, max_requests=4), EngineConfig()
    )
    s = DecodeScheduler(engine, SchedulerConfig(max_queue=4))
    s.start()
    yield s
    s.shutdown()


def _reserve(s: DecodeScheduler, rid: str) -> queue.Queue:
    events: queue.Queue = queue.Queue()
    s.submit(rid, random_tokens(10), GREEDY, events.put, RemoteOpts())
    assert isinstance(events.get(timeout=10), Reserved)
    return events


def _pages_free(s: DecodeScheduler) -> int:
    return s.pool_state().pages_free


def _wait(pred, timeout: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not pred():
        assert time.monotonic() - start < timeout, "condition not reached"
        time.sleep(0.01)
    return time.monotonic() - start


def test_an_abort_under_a_lease_keeps_the_pages_until_the_lease_and_the_grace_have_passed(sched):
    idle = _pages_free(sched)
    events = _reserve(sched, "r1")
    sched.leased("r1", time.time_ns() + int(0.4e9))
    sched.abort("r1")
    assert isinstance(events.get(timeout=5), Finished)  # the client hears at once
    time.sleep(0.2)
    assert _pages_free(sched) < idle, "pages came back while prefill could still write"
    waited = _wait(lambda: _pages_free(sched) == idle)
    assert waited > 0.2  # lease 0.4 s + grace 0.3 s, from the abort
    sched.wait_idle(5)


def test_without_a_lease_or_once_admitted_the_pages_come_back_at_once(sched):
    idle = _pages_free(sched)
    _reserve(sched, "r2")
    sched.abort("r2")  # nothing was sent: no lease
    assert _wait(lambda: _pages_free(sched) == idle, timeout=1.0) < 1.0
    events = _reserve(sched, "r3")
    sched.leased("r3", time.time_ns() + int(30e9))
    sched.prefilled("r3", 5, history=False)  # the writes are known done: the lease ends here
    while not isinstance(events.get(timeout=10), Finished):
        pass
    assert _wait(lambda: _pages_free(sched) == idle, timeout=2.0) < 2.0


def test_a_done_event_that_does_not_open_fails_that_request_only(sched):
    # This decode has no cuda_ipc receiver (CPU): any event handle is one it cannot wait on.
    idle = _pages_free(sched)
    events = _reserve(sched, "r4")
    sched.leased("r4", time.time_ns() + int(0.2e9))
    sched.prefilled("r4", 5, history=True, cuda_ipc_events=(b"\0" * 64,))
    finished = events.get(timeout=5)
    assert isinstance(finished, Finished) and "cuda_ipc event" in (finished.error or "")
    _wait(lambda: _pages_free(sched) == idle)  # after the lease and the grace
    events = _reserve(sched, "r5")  # the scheduler is still serving
    sched.prefilled("r5", 5, history=False)
    while not isinstance(events.get(timeout=10), Finished):
        pass
