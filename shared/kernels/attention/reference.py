"""Vectorized torch attention ops: the CPU path and the correctness reference of the Triton kernels.

Shapes are fixed by host-side sizes only (T, B, max_q, the block table's width, the ring width), so
nothing here waits for the device: sequences are padded to a [B, max_q] query grid and a [B, K] key
grid, and masks decide what is seen. That costs memory (scores are [B, Hkv, max_q * G, K] in fp32)
but is simple enough to trust.

With `quant` (an FP8 cache, `shared/kernels/kv_quant.py`) stores quantize and reads dequantize to
float32; a sliding layer's chunk keys, which attention takes from k_new/v_new rather than the ring,
are read as the ring will hold them (quantized and back), so every key a query sees is what the cache
holds, whichever path computed it.

With `sinks` (gpt-oss's learned attention sinks, float32 [Hq]) query head h's softmax also runs over
one extra logit sinks[h] (not scaled by `scale`) whose probability is dropped, as Hugging Face's eager
gpt-oss does: the outputs shrink by the sink's share, and a row that sees no key gives zeros.

With `fp8_out` (an FP8 cache only) the output is e4m3 codes at V's scale, `quantize(out, 1 / v_scale)`
of the float32 output: what an FP8 o projection takes (`shared/kernels/fp8/ops.py`). Every value
attention sums is a stored V code times v_scale, and softmax weights sum to at most 1, so the codes
stay inside +-448 with no scale of their own to find (e4m3 keeps 3 mantissa bits wherever a value
lands in its range).
"""

from __future__ import annotations

import torch

from shared.kernels._checks import check_paged, check_ring, check_store
from shared.kernels.kv_quant import KVQuant, dequantize, quantize


def store_kv(
    k_new: torch.Tensor, v_new: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
    dst_index: torch.Tensor, quant: KVQuant | None = None,
) -> None:  # fmt: skip
    """Scatter rows: k_dst[dst_index[t]] = k_new[t] (same for v); rows with dst_index < 0 are skipped.
    With `quant` the destination is FP8 and the rows are quantized first."""
    check_store("store_kv", k_new, v_new, k_dst, v_dst, dst_index, quant)
    if k_new.shape[0] == 0:
        return
    if quant is not None:  # the rows' FP8 bytes, moved as uint8 (torch has few float8 ops)
        k_new, v_new = (
            quantize(k_new, quant.inv_k).view(torch.uint8),
            quantize(v_new, quant.inv_v).view(torch.uint8),
        )
        k_dst, v_dst = k_dst.view(torch.uint8), v_dst.view(torch.uint8)
    # Skipped rows cannot be dropped without a data-dependent shape, so they are redirected onto a
    # "donor" (the first kept row) and carry the donor's data: duplicate writes then write identical
    # bytes and the result does not depend on which one lands. With no kept row at all, the donor is
    # row 0 of the destination rewritten with its own value.
    keep = dst_index >= 0
    first = keep.to(torch.int32).argmax().view(1)  # the first kept row, or 0 if none
    any_kept = keep.index_select(0, first)  # [1]
    donor_index = torch.where(any_kept, dst_index.index_select(0, first), 0)
    index = torch.where(keep, dst_index, donor_index)
    for new, dst in ((k_new, k_dst), (v_new, v_dst)):
        donor = torch.where(any_kept[:, None, None], new.index_select(0, first), dst[:1])
        dst.index_copy_(0, index, torch.where(keep[:, None, None], new, donor))


def check_sinks(op: str, sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Attention sinks are float32 [Hq], contiguous, on q's device (None: no sink). Both implementations
    check them here, before anything is stored (shapes and dtypes only: no sync)."""
    if sinks is None:
        return
    want = f"a contiguous float32 tensor [Hq] = [{q.shape[1]}] on {q.device}"
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"{op}: sinks must be {want} or None, got {type(sinks).__name__}")
    if sinks.dtype != torch.float32:
        raise ValueError(f"{op}: sinks must be {want}, got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"{op}: sinks must be {want}, got shape {list(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{op}: sinks must be {want}, got device {sinks.device}")
    if not sinks.is_contiguous():
        raise ValueError(f"{op}: sinks must be {want}, got stride {sinks.stride()}")


def check_fp8_out(op: str, fp8_out: bool, quant: KVQuant | None) -> None:
    """An e4m3 output is in V's codes: it needs an FP8 cache's scales."""
    if fp8_out and quant is None:
        raise ValueError(f"{op}: fp8_out needs an FP8 cache (quant=KVQuant(...)): its codes are at V's scale")


def _gather(cache: torch.Tensor, index: torch.Tensor, scale: float | None) -> torch.Tensor:
    """cache[index]; an FP8 cache's (`scale` given) gathered as bytes and dequantized to float32."""
    if scale is None:
        return cache[index]
    return dequantize(cache.view(torch.uint8)[index].view(cache.dtype), scale)


def _query_grid(
    cu_q: torch.Tensor, q_start: torch.Tensor, max_q: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token index [B, max_q] (clamped), its validity, its position, and each token's grid slot [T]."""
    cu = cu_q.long()
    offs = torch.arange(max_q, device=cu.device)
    qlen = cu[1:] - cu[:-1]
    q_ok = offs[None, :] < qlen[:, None]
    tok = (cu[:-1, None] + offs[None, :]).clamp(0, num_tokens - 1)
    qpos = q_start.long()[:, None] + offs[None, :]
    t = torch.arange(num_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True).clamp(max=cu.shape[0] - 2)
    slot = seq * max_q + (t - cu.index_select(0, seq)).clamp(0, max_q - 1)
    return tok, q_ok, qpos, slot


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, q_ok: torch.Tensor,
    slot: torch.Tensor, scale: float, sinks: torch.Tensor | None, inv_out: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [B, M, Hq, D], k/v [B, K, Hkv, D], visible [B, M, K] -> out [T, Hq, D] gathered by slot;
    sinks [Hq] (or None) join each row's softmax as one more logit whose probability is dropped.
    With `inv_out` the output is e4m3 codes, quantize(out, inv_out), not q's dtype."""
    b, m, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    # Grouped-query heads stay grouped ([B, Hkv, M*G, D]) so K and V are never repeated G times.
    qg = q.float().view(b, m, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, m * g, d)
    scores = (qg @ k.float().permute(0, 2, 3, 1)) * scale  # [B, Hkv, M*G, K]
    # Padded query rows would be all -inf (NaN after softmax); let them see everything, they are dropped.
    mask = visible | ~q_ok[:, :, None]
    mask = mask[:, None, :, None, :].expand(b, 1, m, g, mask.shape[-1]).reshape(b, 1, m * g, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # row (kv head j, query i, group member h) is query head j * G + h
        sink = sinks.view(1, hkv, 1, g).expand(b, hkv, m, g).reshape(b, hkv, m * g, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = probs @ v.float().permute(0, 2, 1, 3)  # [B, Hkv, M*G, D]
    out = out.view(b, hkv, m, g, d).permute(0, 2, 1, 3, 4).reshape(b * m, hq, d)
    out = out.index_select(0, slot)
    return out.to(q.dtype) if inv_out is None else quantize(out, inv_out)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cu_q: torch.Tensor, q_start: torch.Tensor, *, max_q: int, scale: float, window: int | None,
    quant: KVQuant | None = None, sinks: torch.Tensor | None = None, fp8_out: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Causal (optionally sliding-window) attention of varlen queries over a paged KV cache.

    The chunk's own K/V must already be in the cache. Query position p sees keys 0..p, or with a
    window W only p-W+1..p. Contracts: cu_q[-1] == T, every chunk has <= max_q tokens, and each
    sequence's pages up to its last query position are in its block_table row.
    """
    vl = check_paged(
        "paged_attention", q, k_cache, v_cache, block_table, cu_q, q_start, max_q, scale, window, quant
    )
    check_sinks("paged_attention", sinks, q)
    check_fp8_out("paged_attention", fp8_out, quant)
    num_pages, page_size, hkv, d = k_cache.shape
    b, max_pages = block_table.shape
    tok, q_ok, qpos, slot = _query_grid(cu_q, q_start, max_q, vl.num_tokens)
    # Entries past a sequence's last page may be anything (-1, stale): clamp so the gather stays in
    # bounds, and zero what is gathered past the context so stale NaNs cannot leak through 0 * NaN.
    pages = block_table.long().clamp(0, num_pages - 1)
    kpos = torch.arange(max_pages * page_size, device=q.device)
    ctx = (q_start.long() + (cu_q[1:] - cu_q[:-1]).long())[:, None]
    key_ok = kpos[None, :] < ctx  # [B, K]
    keep = key_ok[:, :, None, None]
    k_scale, v_scale = (None, None) if quant is None else (quant.k_scale, quant.v_scale)
    k = torch.where(keep, _gather(k_cache, pages, k_scale).view(b, -1, hkv, d), 0)
    v = torch.where(keep, _gather(v_cache, pages, v_scale).view(b, -1, hkv, d), 0)
    visible = key_ok[:, None, :] & (kpos[None, None, :] <= qpos[:, :, None])
    if window is not None:
        visible &= kpos[None, None, :] > qpos[:, :, None] - window
    return _attend(q[tok], k, v, visible, q_ok, slot, scale, sinks, _inv_out(fp8_out, quant))


def _inv_out(fp8_out: bool, quant: KVQuant | None) -> float | None:
    return quant.inv_v if fp8_out and quant is not None else None


def ring_positions(q_start: torch.Tensor, window: int) -> torch.Tensor:
    """Position held by each ring entry before the chunk ([B, W], int64; < 0 means empty).

    Entry i holds the newest position p <= L0-1 with p % W == i, i.e. p = L0-1 - ((L0-1-i) mod W).
    """
    last = q_start.long()[:, None] - 1
    i = torch.arange(window, device=q_start.device)
    return last - torch.remainder(last - i[None, :], window)


def ring_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
    slots: torch.Tensor, cu_q: torch.Tensor, q_start: torch.Tensor, *, max_q: int, scale: float, window: int,
    quant: KVQuant | None = None, sinks: torch.Tensor | None = None, fp8_out: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Sliding-window attention over a ring of the last W positions plus the chunk's own K/V.

    The ring still holds the history before the chunk (the caller stores the chunk afterwards).
    Query position p sees keys in p-W+1..p drawn from the ring and from the chunk (causally).
    """
    vl = check_ring(
        "ring_attention", q, k_new, v_new, k_ring, v_ring, slots, cu_q, q_start, max_q, scale, window, quant
    )
    check_sinks("ring_attention", sinks, q)
    check_fp8_out("ring_attention", fp8_out, quant)
    tok, q_ok, qpos, slot = _query_grid(cu_q, q_start, max_q, vl.num_tokens)
    ring_pos = ring_positions(q_start, window)
    kpos = torch.cat([ring_pos, qpos], dim=1)  # [B, W + max_q]
    key_ok = torch.cat([ring_pos >= 0, q_ok], dim=1)
    keep = key_ok[:, :, None, None]
    ring_rows = slots.long()
    if quant is None:
        k_hist, v_hist, k_chunk, v_chunk = k_ring[ring_rows], v_ring[ring_rows], k_new[tok], v_new[tok]
    else:  # the chunk's keys as the ring will hold them
        k_hist, v_hist = _gather(k_ring, ring_rows, quant.k_scale), _gather(v_ring, ring_rows, quant.v_scale)
        k_chunk = dequantize(quantize(k_new[tok], quant.inv_k), quant.k_scale)
        v_chunk = dequantize(quantize(v_new[tok], quant.inv_v), quant.v_scale)
    k = torch.where(keep, torch.cat([k_hist, k_chunk], dim=1), 0)
    v = torch.where(keep, torch.cat([v_hist, v_chunk], dim=1), 0)
    rel = kpos[:, None, :] - qpos[:, :, None]  # key position minus query position
    visible = key_ok[:, None, :] & (rel <= 0) & (rel > -window)
    return _attend(q[tok], k, v, visible, q_ok, slot, scale, sinks, _inv_out(fp8_out, quant))
