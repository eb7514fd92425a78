"""Invariants owned by the KV cache, registered at import."""

from __future__ import annotations

from invariants import Invariant, Severity

SWA_HISTORY_PRESENT = Invariant(
    "swa.history_present",
    Severity.FATAL_CONTAINABLE,
    "a sliding layer's ring holds the last W tokens of its request before attention reads it",
)

PREFIX_WINDOW_RESTORED = Invariant(
    "prefix.window_restored",
    Severity.FATAL_CONTAINABLE,
    "a window snapshot restored for a prefix hit holds exactly the last W positions before its boundary",
)

PREFIX_PAGES_INTACT = Invariant(
    "prefix.pages_intact",
    Severity.FATAL_CONTAINABLE,
    "the KV pages a prefix hit reads are bit for bit what was cached (no cached page freed and rewritten)",
)
