"""The ops as the engine drives them: chunked prefill then decode, storing K/V as it goes.

Each step follows the model's order: full layers store the chunk into pages and then attend;
sliding layers attend over ring + chunk and then store the chunk's last W tokens into the ring
(earlier ones get index -1: two writes to one ring entry in one call would race). Every step's
output is checked against the naive attention over the whole history so far.
"""

from __future__ import annotations

import pytest
import torch
from attn_testutil import assert_close, naive

from shared.kernels.attention import AttentionOps, ops_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D, PAGE, W, CHUNK = 4, 2, 16, 4, 5, 4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_then_decode(backend: str) -> None:
    ops: AttentionOps = ops_for(DEVICE, backend=backend)
    gen = torch.Generator().manual_seed(3)
    prompts, decode_steps = [11, 6, 2], 6
    total = [p + decode_steps for p in prompts]
    hist_q = [torch.randn(n, HQ, D, generator=gen) for n in total]
    hist_k = [torch.randn(n, HKV, D, generator=gen) for n in total]
    hist_v = [torch.randn(n, HKV, D, generator=gen) for n in total]
    pages_per_seq = -(-max(total) // PAGE)
    num_pages = len(prompts) * pages_per_seq
    k_cache = torch.zeros(num_pages, PAGE, HKV, D, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # Pages handed out back to front and interleaved between sequences, as a pool would.
    table = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32).view(pages_per_seq, -1).t().contiguous()
    k_ring = torch.zeros(len(prompts) + 1, W, HKV, D, device=DEVICE)
    v_ring = torch.zeros_like(k_ring)
    slots = [2, 0, 1]
    done = [0] * len(prompts)
    scale = D**-0.5
    while any(d < n for d, n in zip(done, total, strict=True)):
        live = [b for b in range(len(prompts)) if done[b] < total[b]]
        specs = []
        for b in live:
            n = min(CHUNK, prompts[b] - done[b]) if done[b] < prompts[b] else 1
            specs.append((done[b], n))
        rows = [(b, p) for b, (l0, n) in zip(live, specs, strict=True) for p in range(l0, l0 + n)]
        q = torch.stack([hist_q[b][p] for b, p in rows]).to(DEVICE)
        k_new = torch.stack([hist_k[b][p] for b, p in rows]).to(DEVICE)
        v_new = torch.stack([hist_v[b][p] for b, p in rows]).to(DEVICE)
        cu = torch.tensor([0, *torch.tensor([n for _, n in specs]).cumsum(0).tolist()], dtype=torch.int32)
        q_start = torch.tensor([l0 for l0, _ in specs], dtype=torch.int32)
        page_dst = torch.tensor([int(table[b, p // PAGE]) * PAGE + p % PAGE for b, p in rows])
        last = {b: l0 + n for b, (l0, n) in zip(live, specs, strict=True)}
        ring_dst = torch.tensor([slots[b] * W + p % W if p >= last[b] - W else -1 for b, p in rows])
        args = {"cu_q": cu.to(DEVICE), "q_start": q_start.to(DEVICE), "max_q": max(n for _, n in specs)}

        ops.store_kv(k_new, v_new, k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D), page_dst.to(DEVICE))
        bt = table[live].to(DEVICE)
        full = ops.paged_attention(q, k_cache, v_cache, bt, **args, scale=scale, window=None)
        windowed = ops.paged_attention(q, k_cache, v_cache, bt, **args, scale=scale, window=W)
        ring_slots = torch.tensor([slots[b] for b in live], dtype=torch.int32, device=DEVICE)
        ring = ops.ring_attention(q, k_new, v_new, k_ring, v_ring, ring_slots, **args, scale=scale, window=W)
        ops.store_kv(k_new, v_new, k_ring.view(-1, HKV, D), v_ring.view(-1, HKV, D), ring_dst.to(DEVICE))

        hk = [hist_k[b][: last[b]] for b in live]
        hv = [hist_v[b][: last[b]] for b in live]
        q_cpu = q.cpu()
        assert_close(full, naive(q_cpu, hk, hv, specs, window=None, scale=scale))
        expected = naive(q_cpu, hk, hv, specs, window=W, scale=scale)
        assert_close(windowed, expected)
        assert_close(ring, expected)
        for b, (_, n) in zip(live, specs, strict=True):
            done[b] += n
