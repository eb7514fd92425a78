"""Invariants owned by the KV cache, registered at import."""

from __future__ import annotations

from invariants import Invariant, Severity

SWA_HISTORY_PRESENT = Invariant(
    "swa.history_present",
    Severity.FATAL_CONTAINABLE,
    "a sliding layer's ring holds the last W tokens of its request before attention reads it",
)
