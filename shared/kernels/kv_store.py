"""Where a layer's new K/V rows go when a kernel other than attention stores them (RoPE's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kernels.kv_quant import KVQuant

Tensor = torch.Tensor

__all__ = ["KVStore"]


@dataclass(frozen=True)
class KVStore:
    """Where a layer's new K/V rows go: row t to `k_dst[index[t]]` / `v_dst[index[t]]` ([S, Hkv, D]
    flat cache rows, shared/kernels/attention's `store_kv` layout); index < 0 skips the row. `quant`:
    the cache is FP8 with these scales, and the rows are quantized on the way
    (shared/kernels/kv_quant.py)."""

    k_dst: Tensor
    v_dst: Tensor
    index: Tensor
    quant: KVQuant | None = None
