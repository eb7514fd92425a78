"""Sync-free invariants: correctness checks on device tensors that never make the CPU wait.

    SWA_PRESENT = Invariant("swa.history_present", Severity.FATAL_CONTAINABLE, "window holds W tokens")
    expect(SWA_PRESENT, lambda: predicates.equal(stored_pos, wanted_pos), rows=request_slots)
    ...
    for v in invariants.checker(device).poll(): ...   # where the scheduler already waits
    with invariants.concurrent_checks(device): ...     # its checks run beside its kernels (CUDA)
    with invariants.batched_checks(device): ...        # its checks launch at its end, one kernel per kind

Levels come from PDSERVE_INVARIANT_CHECK (off | warn | strict, with per-namespace overrides).
"""

from __future__ import annotations

from invariants import predicates
from invariants.api import batched_checks, checker, concurrent_checks, enabled, expect, reset_checkers
from invariants.checker import Checker, Listener
from invariants.levels import Level, LevelConfig, configure, level_of, levels
from invariants.registry import (
    Invariant,
    InvariantError,
    InvariantViolation,
    Severity,
    Violation,
    all_invariants,
    get,
    strict_message,
)

__all__ = [
    "Checker",
    "Invariant",
    "InvariantError",
    "InvariantViolation",
    "Level",
    "LevelConfig",
    "Listener",
    "Severity",
    "Violation",
    "all_invariants",
    "batched_checks",
    "checker",
    "concurrent_checks",
    "configure",
    "enabled",
    "expect",
    "get",
    "level_of",
    "levels",
    "predicates",
    "reset_checkers",
    "strict_message",
]
