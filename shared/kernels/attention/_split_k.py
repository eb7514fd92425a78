"""Split-K (flash-decoding) pieces the paged and the ring kernels share (helpers, not a kernel).

A kernel launched with num_splits > 1 runs num_splits programs per query tile; split s reads the
keys `split_range` gives it and `store_result` writes its normalized output and log2-sum-exp as one
row of the fp32 partials. The last of a query tile's splits to finish merges them into the output
(`merge_rows`), in the same kernel: each split takes a ticket from a counter of its tile after its
partial rows are written, and the one that draws num_splits - 1 reads every split's rows back and
sets the counter to zero again. So a split call is one launch, with no merge kernel after it. How
many splits a call gets is `_launch.choose_splits`. With attention sinks split 0 alone starts from
the sink (`_online_softmax.softmax_start`): its lse carries the sink's mass even when it reads no
key, and the merge counts the sink once.

An e4m3 output (`outputs(..., fp8_out=True)`: an FP8 cache's attention feeding an FP8 o projection)
holds codes at V's scale: the kernels leave V's scale off the sum, so the normalized output is a
convex combination of V's stored codes, inside +-448, stored saturated and rounded to nearest-even
(`_round.to_output`) with no scale to compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._launch import next_pow2
from shared.kernels._round import to_output
from shared.kernels.kv_quant import FP8_KV_DTYPE as FP8_OUT


@triton.jit
def split_range(lo, hi, split, num_splits, BLOCK_N: tl.constexpr):
    """The keys [first, last) of split `split` in [lo, hi): whole BLOCK_N tiles, dealt out evenly.

    Tile counts differ by at most one between splits, so no split gets a long tail while another is
    empty (rounding each split up to whole tiles would leave the last ones empty); with more splits
    than tiles some splits get none. num_splits == 1 gives [lo, hi).
    """
    tiles = tl.cdiv(hi - lo, BLOCK_N)
    first = lo + (split * tiles // num_splits) * BLOCK_N
    last = lo + ((split + 1) * tiles // num_splits) * BLOCK_N
    return first, tl.minimum(hi, last)


@triton.jit
def store_result(
    acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, tickets_ptr, tok, head, row_ok, split, num_tokens,
    num_q_heads, stride_ot, stride_oh, num_splits, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Normalize the running softmax and store it: the output itself, or (SPLIT: num_splits > 1, a
    launch constant, so that an unsplit kernel holds no merge) this split's partial row and, from the
    query tile's last split to finish, the merge of all of them."""
    d = tl.arange(0, BLOCK_D)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    if not SPLIT:
        out = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out, to_output(o, out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials are [num_splits, T, Hq, (D)]; a split that saw no key has lse = -inf and weighs nothing.
        row = (split * num_tokens + tok) * num_q_heads + head
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
        # Every thread's rows are written before the ticket (the barrier), and the ticket's release
        # publishes them to the program that draws the last one, whose acquire orders its reads after.
        tl.debug_barrier()
        tiles = tl.num_programs(0) // num_splits
        at = tickets_ptr + (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)) * tiles
        at += tl.program_id(0) // num_splits
        ticket = tl.atomic_add(at, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            merge_rows(
                part_o_ptr, part_lse_ptr, out_ptr, tok, head, row_ok, num_tokens, num_q_heads, stride_ot,
                stride_oh, num_splits, BLOCK_M, BLOCK_D, HEAD_DIM,
            )  # fmt: skip
            tl.store(at, 0)  # for the next launch, which starts after this one ends


@triton.jit
def merge_rows(
    part_o_ptr, part_lse_ptr, out_ptr, tok, head, row_ok, num_tokens, num_q_heads, stride_ot, stride_oh,
    num_splits, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The output rows of one query tile from its splits' partials: sum_s w_s o_s / sum_s w_s, with
    w_s = 2^(lse_s - max lse); an empty split (lse = -inf) weighs zero and its o is never read. Loads
    go to L2 (`.cg`): the partials were written by other SMs, whose rows no L1 of this one may hold."""
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    lse_at = part_lse_ptr + tok * num_q_heads + head
    top = tl.load(lse_at, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
    for s in range(1, num_splits):
        row = (s * num_tokens + tok) * num_q_heads + head
        lse = tl.load(part_lse_ptr + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.maximum(top, lse)
    top = tl.where(top > float("-inf"), top, 0.0)  # a row no split saw: every weight is 0 (not NaN)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    merged = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        row = (s * num_tokens + tok) * num_q_heads + head
        lse = tl.load(part_lse_ptr + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
        o_at = part_o_ptr + row[:, None] * HEAD_DIM + d[None, :]
        o = tl.load(o_at, mask=mask & (w > 0)[:, None], other=0.0, cache_modifier=".cg")
        merged += o * w[:, None]
        total += w
    merged = merged / tl.where(total > 0, total, 1.0)[:, None]
    out = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out, to_output(merged, out_ptr.dtype.element_ty), mask=mask)


_UNUSED: dict[torch.device, torch.Tensor] = {}
# Each device's split tickets: int32 counters, one a (query tile, sequence, kv head), zero between
# launches. The buffers are never freed, so that a CUDA graph that captured one keeps it; a larger
# grid than the newest holds gets a new one. The kernels that use them run one after another on a
# device (its one stream), each leaving them zero.
_TICKETS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_TICKETS = 1 << 14


def tickets(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least `count` split tickets on `device`."""
    held = _TICKETS.setdefault(device, [])
    if not held or held[-1].numel() < count:
        held.append(torch.zeros(max(_MIN_TICKETS, next_pow2(count)), dtype=torch.int32, device=device))
    return held[-1]


def outputs(
    q: torch.Tensor, num_splits: int, tiles_launched: int, fp8_out: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, part_o, part_lse, tickets): out like q (e4m3 with `fp8_out`), and with splits the fp32
    partials [S, T, Hq, D], [S, T, Hq] and the tickets of `tiles_launched` query tiles (the grid's
    programs over num_splits).

    Without splits the kernel never touches the partials or the tickets; small stand-ins of the same
    types take their place (Triton compiles per pointer type).
    """
    out = torch.empty_like(q, dtype=FP8_OUT if fp8_out else q.dtype, memory_format=torch.contiguous_format)
    if num_splits == 1:
        unused = _UNUSED.get(q.device)
        if unused is None:
            unused = _UNUSED[q.device] = torch.empty(1, dtype=torch.float32, device=q.device)
        return out, unused, unused, tickets(q.device, 1)
    part_o = torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_splits, *q.shape[:2], dtype=torch.float32, device=q.device)
    return out, part_o, part_lse, tickets(q.device, tiles_launched)
