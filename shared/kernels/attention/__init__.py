"""Attention ops of the engine: paged and sliding-window-ring attention, and the KV scatter.

`ops_for(device)` picks the implementation: Triton kernels on CUDA, vectorized torch elsewhere.
Layouts and semantics are in `ops.AttentionOps` and `reference`.
"""

from __future__ import annotations

from shared.kernels.attention.ops import AttentionOps, TorchOps, TritonOps, ops_for

__all__ = ["AttentionOps", "TorchOps", "TritonOps", "ops_for"]
