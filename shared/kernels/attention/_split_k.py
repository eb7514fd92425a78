"""Split-K (flash-decoding) pieces the paged and the ring kernels share (helpers, not a kernel).

A kernel launched with num_splits > 1 runs num_splits programs per query tile; split s reads the
keys `split_range` gives it and `store_result` writes its normalized output and log2-sum-exp as one
row of the fp32 partials, which `merge` (the `merge_splits` kernel) combines. How many splits a call
gets is `_launch.choose_splits`. With attention sinks split 0 alone starts from the sink
(`_online_softmax.softmax_start`): its lse carries the sink's mass even when it reads no key, and the
merge counts the sink once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shared.kernels._fp8_tile import quantize_tile
from shared.kernels.attention.merge_splits import merge_splits
from shared.kernels.fp8_act import E4M3, Fp8Act, scale_buffer


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
    stride_ot, stride_oh, num_splits, kvh, q8_ptr, qs_ptr, stride_q8t, stride_qsg, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, QUANT_OUT: tl.constexpr,
):  # fmt: skip
    """Normalize the running softmax and store it: the output itself, or this split's partial row.

    QUANT_OUT (an unsplit decode call, one token a tile): the output as the FP8 o projection takes
    it instead, rounded to the output's dtype as it would be stored, then quantized to e4m3 with one
    scale for the tile, its token's query heads of kv head `kvh`: rows of q8 [T, Hq * D], the scale
    at qs [token, kvh] (column-major, stride_qsg = T)."""
    d = tl.arange(0, BLOCK_D)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    if num_splits == 1:
        if QUANT_OUT:
            o = tl.where(mask, o.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
            q8, scale = quantize_tile(o)
            q8_rows = q8_ptr + tok[:, None] * stride_q8t + head[:, None] * HEAD_DIM
            tl.store(q8_rows + d[None, :], q8, mask=mask)
            tl.store(qs_ptr + tok + kvh * stride_qsg, tl.where(row_ok, scale, 0.0), mask=row_ok)
        else:
            out = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials are [num_splits, T, Hq, (D)]; a split that saw no key has lse = -inf and weighs nothing.
        row = (split * num_tokens + tok) * num_q_heads + head
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)


_UNUSED: dict[torch.device, torch.Tensor] = {}


def outputs(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, part_o, part_lse): out like q, and with splits the fp32 partials [S, T, Hq, D], [S, T, Hq].

    Without splits the kernel never touches the partials; an fp32 stand-in takes their place, so that
    split and unsplit launches share one compiled kernel (Triton compiles per pointer type).
    """
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
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


class QuantOut(NamedTuple):
    """Where a decode call writes its output quantized for the FP8 o projection (`store_result`'s
    QUANT_OUT): e4m3 rows [T, Hq * D] and one float32 scale a token and kv head, [T, Hkv] column-major
    as the FP8 quantizers write theirs; fp32 stand-ins when the call stores its output as it is."""

    fused: bool
    data: torch.Tensor
    scale: torch.Tensor

    def args(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The kernel's q8_ptr, qs_ptr, stride_q8t and stride_qsg."""
        return self.data, self.scale, self.data.stride(0), self.scale.stride(1)

    def result(self, out: torch.Tensor, num_kv_heads: int) -> torch.Tensor | Fp8Act:
        """The call's result: `out`, or the quantized rows, a scale every Hq / Hkv * D columns."""
        if not self.fused:
            return out
        return Fp8Act(self.data, self.scale, self.data.shape[1] // num_kv_heads, out.dtype)


def quant_out(q: torch.Tensor, num_kv_heads: int, wanted: bool, num_splits: int, block_q: int) -> QuantOut:
    """A call's `QuantOut`: fused where the output was `wanted` quantized and the call can (one kernel
    writes it: no split; one token a tile, whose heads of one kv head are one scale group)."""
    if not (wanted and num_splits == 1 and block_q == 1):
        _, unused, _ = outputs(q, 1)
        return QuantOut(False, unused.view(1, 1), unused.view(1, 1))
    tokens = q.shape[0]
    data = torch.empty((tokens, q.shape[1] * q.shape[2]), dtype=E4M3, device=q.device)
    return QuantOut(True, data, scale_buffer(tokens, num_kv_heads, q.device))
