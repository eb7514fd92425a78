"""Each severity at each level: what is launched, what is counted, what crashes (CPU)."""

from __future__ import annotations

import pytest
import torch

import invariants
from invariants import Invariant, InvariantViolation, Severity, expect, levels, predicates

CHECKS = {sev: Invariant(f"test_sev.{sev.value}", sev, f"a {sev.value} check") for sev in Severity}
ROWS = torch.tensor([10, 11, 12])
FAILING = torch.tensor([False, True, False])  # elementwise-ok: rows 10 and 12 fail


def totals():
    return invariants.checker("cpu").poll()


@pytest.mark.parametrize("sev", list(Severity))
def test_off_launches_nothing_and_never_calls_the_predicate(sev):
    def predicate():
        raise AssertionError("evaluated at OFF")

    with levels("off"):
        expect(CHECKS[sev], predicate, rows=ROWS)
        expect(CHECKS[sev], FAILING, rows=ROWS)
        assert not invariants.enabled(CHECKS[sev])
    assert invariants.checker("cpu").totals() == {}


@pytest.mark.parametrize("sev", [Severity.SOFTEN, Severity.GUARD, Severity.FATAL_CONTAINABLE])
def test_warn_counts_and_attributes_without_raising(sev):
    with levels("warn"):
        expect(CHECKS[sev], FAILING, rows=ROWS)
        [v] = totals()
    assert (v.name, v.severity, v.new_hits, v.total, v.rows) == (CHECKS[sev].name, sev, 2, 2, (10, 12))


def test_warn_crashes_on_an_uncontainable_violation():
    with levels("warn"), pytest.raises(InvariantViolation, match=r"FAILED \[test_sev.fatal_uncontainable\]"):
        expect(CHECKS[Severity.FATAL_UNCONTAINABLE], FAILING)


@pytest.mark.parametrize("sev", [Severity.GUARD, Severity.FATAL_CONTAINABLE, Severity.FATAL_UNCONTAINABLE])
def test_strict_crashes_with_the_invariants_name(sev):
    with levels("strict"), pytest.raises(InvariantViolation) as err:
        expect(CHECKS[sev], FAILING, rows=ROWS)
    assert str(err.value) == f"invariant-check FAILED [{CHECKS[sev].name}]"


def test_strict_never_crashes_on_soften():
    with levels("strict"):
        expect(CHECKS[Severity.SOFTEN], FAILING, rows=ROWS)
        [v] = totals()
    assert v.new_hits == 2 and v.rows == (10, 12)


@pytest.mark.parametrize("level", ["warn", "strict"])
@pytest.mark.parametrize("sev", list(Severity))
def test_a_holding_predicate_never_reports(level, sev):
    with levels(level):
        expect(CHECKS[sev], lambda: predicates.equal(ROWS, ROWS.clone()), rows=ROWS)
        assert totals() == []


def test_hits_accumulate_and_totals_are_cumulative():
    inv = CHECKS[Severity.SOFTEN]
    with levels("warn"):
        expect(inv, FAILING)
        expect(inv, FAILING)
        [v] = totals()
        assert (v.new_hits, v.total, v.rows) == (4, 4, ())
        expect(inv, torch.tensor([False]))
        [v] = totals()
        assert (v.new_hits, v.total) == (1, 5)
        assert totals() == []
    assert invariants.checker("cpu").totals()[inv.name] == 5


def test_expect_rejects_what_is_not_a_predicate():
    with levels("warn"), pytest.raises(invariants.InvariantError, match="Predicate or a bool tensor"):
        expect(CHECKS[Severity.SOFTEN], lambda: [True, False])


def test_rows_must_match_the_predicates_rows():
    with levels("warn"), pytest.raises(invariants.InvariantError, match="rows must be a 1-D tensor of 3"):
        expect(CHECKS[Severity.SOFTEN], FAILING, rows=torch.tensor([1, 2]))
