"""The case the invariants design was verified with: guarding a sliding-window layer's history.

A request's ring holds the positions of its last W tokens; before a sliding layer reads it, the
history must be present. Missing history is FATAL_CONTAINABLE: at WARN only that request is hurt.
"""

from __future__ import annotations

import pytest
import torch

import invariants
from invariants import InvariantViolation, expect, levels, predicates
from invariants.predicates import window_expected
from shared.engine.kv.invariants import SWA_HISTORY_PRESENT

W = 8
SLOTS = torch.tensor([3, 7, 9])  # stable request slots of the three running requests
SEQ_LENS = torch.tensor([5, 8, 21])


def check_history(pos: torch.Tensor) -> None:
    expect(SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, SEQ_LENS), rows=SLOTS)


def missing_history() -> torch.Tensor:
    pos = window_expected(SEQ_LENS, W)
    pos[2] = -1  # the request in slot 9 arrived without its history
    return pos


def test_matching_history_passes_at_strict():
    with levels("strict"):
        check_history(window_expected(SEQ_LENS, W))
    assert invariants.checker("cpu").poll() == []


def test_missing_history_passes_at_off():
    with levels("off"):
        check_history(missing_history())
    assert invariants.checker("cpu").poll() == []


def test_missing_history_trips_strict_with_the_invariants_name():
    with (
        levels("strict"),
        pytest.raises(InvariantViolation, match=r"^invariant-check FAILED \[swa.history_present\]$"),
    ):
        check_history(missing_history())


def test_missing_history_at_warn_is_counted_and_attributed_to_that_request():
    with levels("warn"):
        check_history(missing_history())
        [v] = invariants.checker("cpu").poll()
    assert (v.name, v.new_hits, v.total, v.rows) == ("swa.history_present", 1, 1, (9,))
    assert v.severity is invariants.Severity.FATAL_CONTAINABLE
