"""Batches laid out like the engine's, and a deliberately naive attention to hold the ops to.

A batch is built from whole per-sequence K/V histories (ground truth). From them we write the
paged cache (pages shuffled, unused slots and table entries filled with NaN / -1 so that reading
anything outside a sequence shows up) and the ring (holding only the W positions before the chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NAN_FILL = float("nan")

TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


@dataclass
class Batch:
    specs: list[tuple[int, int]]  # (tokens already cached L0, chunk length n) per sequence
    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    hist_k: list[torch.Tensor]  # per sequence [L0 + n, Hkv, D]: every position, the chunk included
    hist_v: list[torch.Tensor]
    cu_q: torch.Tensor  # [B+1] int32
    q_start: torch.Tensor  # [B] int32
    max_q: int
    scale: float
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D], chunk already stored
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32, -1 past each sequence's pages
    window: int | None
    k_ring: torch.Tensor | None  # [num_slots, W, Hkv, D], history before the chunk only
    v_ring: torch.Tensor | None
    slots: torch.Tensor | None  # [B] int32

    def paged_args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.cu_q, self.q_start)

    def ring_args(self) -> tuple[torch.Tensor, ...]:
        assert self.k_ring is not None and self.v_ring is not None and self.slots is not None
        return (self.q, self.k_new, self.v_new, self.k_ring, self.v_ring, self.slots, self.cu_q, self.q_start)


def make_batch(
    specs: list[tuple[int, int]], *, hq: int = 4, hkv: int = 2, d: int = 16, page_size: int = 4,
    window: int | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
) -> Batch:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    hist_k = [randn(l0 + n, hkv, d) for l0, n in specs]
    hist_v = [randn(l0 + n, hkv, d) for l0, n in specs]
    q = randn(sum(n for _, n in specs), hq, d)
    k_new = torch.cat([hk[l0:] for hk, (l0, _) in zip(hist_k, specs, strict=True)])
    v_new = torch.cat([hv[l0:] for hv, (l0, _) in zip(hist_v, specs, strict=True)])
    cu = [0]
    for _, n in specs:
        cu.append(cu[-1] + n)

    # Paged cache: shuffled pages, one spare page, one spare table column.
    need = [math.ceil((l0 + n) / page_size) for l0, n in specs]
    num_pages = sum(need) + 1
    order = torch.randperm(num_pages, generator=gen).tolist()
    k_cache = torch.full((num_pages, page_size, hkv, d), NAN_FILL, dtype=dtype)
    v_cache = torch.full_like(k_cache, NAN_FILL)
    table = torch.full((len(specs), max(need) + 1), -1, dtype=torch.int32)
    for b, (hk, hv) in enumerate(zip(hist_k, hist_v, strict=True)):
        for p in range(hk.shape[0]):
            if p % page_size == 0:
                table[b, p // page_size] = order.pop()
            page = int(table[b, p // page_size])
            k_cache[page, p % page_size] = hk[p]
            v_cache[page, p % page_size] = hv[p]

    k_ring = v_ring = slots = None
    if window is not None:
        num_slots = len(specs) + 2
        slot_ids = torch.randperm(num_slots, generator=gen)[: len(specs)]
        k_ring = torch.full((num_slots, window, hkv, d), NAN_FILL, dtype=dtype)
        v_ring = torch.full_like(k_ring, NAN_FILL)
        for b, (l0, _) in enumerate(specs):
            for p in range(max(0, l0 - window), l0):
                k_ring[slot_ids[b], p % window] = hist_k[b][p]
                v_ring[slot_ids[b], p % window] = hist_v[b][p]
        slots = slot_ids.to(torch.int32).to(device)
        k_ring, v_ring = k_ring.to(device), v_ring.to(device)

    return Batch(
        specs=specs, q=q.to(device), k_new=k_new.to(device), v_new=v_new.to(device),
        hist_k=[h.to(device) for h in hist_k], hist_v=[h.to(device) for h in hist_v],
        cu_q=torch.tensor(cu, dtype=torch.int32, device=device),
        q_start=torch.tensor([l0 for l0, _ in specs], dtype=torch.int32, device=device),
        max_q=max(n for _, n in specs), scale=d**-0.5, k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_table=table.to(device), window=window, k_ring=k_ring, v_ring=v_ring, slots=slots,
    )  # fmt: skip


def naive_attention(batch: Batch) -> torch.Tensor:
    return naive(batch.q, batch.hist_k, batch.hist_v, batch.specs, window=batch.window, scale=batch.scale)


def naive(
    q: torch.Tensor, hist_k: list[torch.Tensor], hist_v: list[torch.Tensor], specs: list[tuple[int, int]], *,
    window: int | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Per sequence, per query: list the visible key positions, softmax in float64. Obviously right."""
    group = q.shape[1] // hist_k[0].shape[1]
    out = []
    t = 0
    for (l0, n), hk, hv in zip(specs, hist_k, hist_v, strict=True):
        for i in range(n):
            pos = l0 + i
            first = 0 if window is None else max(0, pos - window + 1)
            keys = list(range(first, pos + 1))
            k = hk[keys].double().repeat_interleave(group, dim=1)  # [K, Hq, D]
            v = hv[keys].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[t].double(), k) * scale
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
            t += 1
    return torch.stack(out).to(q.dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **TOLERANCE[expected.dtype])
