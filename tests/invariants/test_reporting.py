"""poll(): listeners, recovery hooks, row attribution per poll, and throttled logging."""

from __future__ import annotations

import logging

import torch

from invariants import Checker, Invariant, Severity, Violation, predicates

recovered: list[Violation] = []
SOFT = Invariant("test_reporting.soft", Severity.SOFTEN, "an informational check")
GUARDED = Invariant("test_reporting.guarded", Severity.GUARD, "a guard")
CONTAINED = Invariant(
    "test_reporting.contained", Severity.FATAL_CONTAINABLE, "abort the rows", recover=recovered.append
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fail_rows(checker: Checker, inv: Invariant, rows: list[int], batch: int = 8) -> None:
    ids = torch.arange(batch) + 100
    ok = torch.ones(batch, dtype=torch.bool)
    ok[[r - 100 for r in rows]] = False
    checker.check(inv, predicates.is_true(ok), ids, crash=False)


def test_listeners_then_recover_receive_each_violation():
    checker = Checker("cpu")
    seen: list[Violation] = []
    checker.add_listener(seen.append)
    recovered.clear()
    fail_rows(checker, CONTAINED, [101, 105])
    fail_rows(checker, SOFT, [100])
    found = checker.poll()
    assert found == seen
    assert [(v.name, v.rows) for v in found] == [
        ("test_reporting.contained", (101, 105)),
        ("test_reporting.soft", (100,)),
    ]
    assert recovered == [found[0]]
    checker.remove_listener(seen.append)
    fail_rows(checker, SOFT, [100])
    checker.poll()
    assert len(seen) == 2


def test_rows_are_those_that_failed_since_the_last_poll():
    checker = Checker("cpu")
    fail_rows(checker, GUARDED, [103])
    assert checker.poll()[0].rows == (103,)
    fail_rows(checker, GUARDED, [104])
    [v] = checker.poll()
    assert (v.rows, v.new_hits, v.total) == ((104,), 1, 2)


def test_row_ids_span_the_whole_bitmask():
    checker = Checker("cpu", max_rows=128)
    ids = torch.tensor([0, 31, 32, 63, 127, 128])  # 128 is beyond max_rows: counted, not attributed
    checker.check(GUARDED, predicates.is_true(torch.zeros(6, dtype=torch.bool)), ids, crash=False)
    [v] = checker.poll()
    assert v.rows == (0, 31, 32, 63, 127) and v.new_hits == 6


def test_logging_is_throttled_per_invariant(caplog):
    clock = FakeClock()
    checker = Checker("cpu", log_interval_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="pdserve.invariants")

    fail_rows(checker, GUARDED, [100])
    checker.poll()
    assert [r.getMessage() for r in caplog.records] == [
        "invariant test_reporting.guarded violated: 1 hits, rows [100] (a guard)"
    ]
    assert caplog.records[0].levelno == logging.WARNING

    for _ in range(3):  # within the interval: counted, not logged
        clock.now += 2
        fail_rows(checker, GUARDED, [101, 102])
        checker.poll()
    assert len(caplog.records) == 1

    clock.now += 5  # interval elapsed: one line for everything since, even with no new hits
    checker.poll()
    assert caplog.records[-1].getMessage() == "invariant test_reporting.guarded: +6 hits, 7 total"
    clock.now += 30
    checker.poll()
    assert len(caplog.records) == 2


def test_each_severity_logs_at_its_own_level(caplog):
    checker = Checker("cpu")
    caplog.set_level(logging.INFO, logger="pdserve.invariants")
    fail_rows(checker, SOFT, [100])
    fail_rows(checker, CONTAINED, [100])
    checker.poll()
    levels = {r.getMessage().split()[1]: r.levelno for r in caplog.records}
    assert levels == {"test_reporting.soft": logging.INFO, "test_reporting.contained": logging.ERROR}


def test_a_checker_first_used_inside_inference_mode_still_polls():
    import invariants

    invariants.reset_checkers()
    with invariants.levels("warn"), torch.inference_mode():
        invariants.expect(GUARDED, torch.tensor([False]))
    assert invariants.checker("cpu").poll()[0].new_hits == 1
