"""Split-K (flash-decoding) pieces the paged and the ring kernels share (helpers, not a kernel).

A kernel launched with num_splits > 1 runs num_splits programs per query tile; split s reads the
keys `split_range` gives it and `store_result` writes its normalized output and log2-sum-exp as one
row of the fp32 partials, which `merge` (the `merge_splits` kernel) combines. How many splits a call
gets is `_launch.choose_splits`. With attention sinks split 0 alone starts from the sink
(`_online_softmax.softmax_start`): its lse carries the sink's mass even when it reads no key, and the
merge counts the sink once.

An e4m3 output (`outputs(..., fp8_out=True)`: an FP8 cache's attention feeding an FP8 o projection)
holds codes at V's scale: the kernels leave V's scale off the sum, so the normalized output is a
convex combination of V's stored codes, inside +-448, stored saturated and rounded to nearest-even
(`_round.to_output`) with no scale to compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels._round import to_output
from shared.kernels.attention.merge_splits import merge_splits
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
    acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, tok, head, row_ok, split, num_tokens, num_q_heads,
    stride_ot, stride_oh, num_splits, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Normalize the running softmax and store it: the output itself, or this split's partial row."""
    d = tl.arange(0, BLOCK_D)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    if num_splits == 1:
        out = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out, to_output(o, out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials are [num_splits, T, Hq, (D)]; a split that saw no key has lse = -inf and weighs nothing.
        row = (split * num_tokens + tok) * num_q_heads + head
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)


_UNUSED: dict[torch.device, torch.Tensor] = {}


def outputs(
    q: torch.Tensor, num_splits: int, fp8_out: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, part_o, part_lse): out like q (e4m3 with `fp8_out`), and with splits the fp32 partials
    [S, T, Hq, D], [S, T, Hq].

    Without splits the kernel never touches the partials; an fp32 stand-in takes their place, so that
    split and unsplit launches share one compiled kernel (Triton compiles per pointer type).
    """
    out = torch.empty_like(q, dtype=FP8_OUT if fp8_out else q.dtype, memory_format=torch.contiguous_format)
    if num_splits == 1:
        unused = _UNUSED.get(q.device)
        if unused is None:
            unused = _UNUSED[q.device] = torch.empty(1, dtype=torch.float32, device=q.device)
        return out, unused, unused
    part_o = torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_splits, *q.shape[:2], dtype=torch.float32, device=q.device)
    return out, part_o, part_lse


def merge(out: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, num_splits: int) -> torch.Tensor:
    """The final output: `out` as the kernel wrote it, or the merge of the partials into it."""
    if num_splits > 1:
        merge_splits(part_o, part_lse, out)
    return out
