"""Triton kernels of the invariants library (one kernel per file)."""
