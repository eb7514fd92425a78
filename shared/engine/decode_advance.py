"""A greedy decode step on a CUDA graph moves the graph's inputs on to the next step itself.

In steady decode (the same requests in the same rows of a graph, each one token further) what a step
uploads is the rows' position fields, each one more than the step before's. The argmax kernel that
ends a greedy graph step already writes its tokens into the graph's input ids (`argmax_rows`'s
`feed_out`); with a `DecodeAdvance` the program that settles a row also moves that row's position
fields one token on, so that the next step on the same rows uploads nothing: on an H200 the upload
and the longer gap it leaves before the graph's first kernel cost ~10-25 us a step
(docs/benchmarks.md).

The values are the host's (`DecodeBatcher.build`) for position p + 1: the position, q_start,
ring_context and ring_pos; the sample position p + 2; the ring index slot * W + (p + 1) mod W, where
the key is stored and where the ring's position is written; the page index table[row, (p + 1) // P]
* P + (p + 1) mod P (-1 past the table's width: nothing stored). Rows past the logits' (a graph's
padding) are not touched.

Whether the next step uses them is the host's decision: `DecodeBatcher` skips the upload only when
the rows, the block table on the device and the fed input ids are the step before's and every
position moved by exactly one; any other step uploads, which overwrites what the device moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.engine.batch import ForwardBatch

__all__ = ["DecodeAdvance", "advance_row"]


@dataclass(frozen=True)
class DecodeAdvance:
    """A decode batch's fields, to be moved one position on for its first `rows` rows."""

    batch: ForwardBatch
    page_size: int
    window: int  # the ring's length: `KVCache.ring_len`

    def __post_init__(self) -> None:
        b = self.batch
        if b.num_tokens != b.num_seqs or b.ring_dst.numel() != b.num_seqs:
            raise ValueError("DecodeAdvance: a decode batch (one token, one ring store a row) is required")
        if not b.block_table.is_contiguous():
            raise ValueError("DecodeAdvance: the block table must be contiguous (rows of its width)")
        if self.page_size < 1 or self.window < 1:
            raise ValueError(
                f"DecodeAdvance: page_size and window must be >= 1, got {self.page_size} and {self.window}"
            )

    def kernel_args(self) -> tuple[object, ...]:
        """`advance_row`'s arguments after `row`, in its order."""
        b = self.batch
        return (
            b.positions, b.sample_positions, b.q_start, b.ring_context, b.ring_pos, b.full_store,
            b.ring_store, b.ring_dst, b.slots, b.block_table, b.block_table.shape[1], self.page_size,
            self.window,
        )  # fmt: skip

    def apply(self, rows: int) -> None:
        """The same in torch ops, where torch takes the argmax (a CPU batch)."""
        b, n = self.batch, rows
        nxt = b.positions[:n] + 1
        b.positions[:n] = nxt
        b.sample_positions[:n] = nxt + 1
        for f in (b.q_start, b.ring_context, b.ring_pos):
            f[:n] = nxt.to(f.dtype)
        ring = b.slots[:n].to(torch.int64) * self.window + nxt % self.window
        b.ring_store[:n] = ring
        b.ring_dst[:n] = ring
        page = nxt // self.page_size
        width = b.block_table.shape[1]
        inside = page < width
        at = b.block_table[:n].gather(1, page.clamp(max=width - 1).unsqueeze(1)).squeeze(1).to(torch.int64)
        b.full_store[:n] = torch.where(inside, at * self.page_size + nxt % self.page_size, -1)


@triton.jit
def advance_row(
    row, pos_ptr, spos_ptr, qs_ptr, rc_ptr, rp_ptr, full_ptr, rs_ptr, rd_ptr, slots_ptr, table_ptr, width,
    page_size, window,
):  # fmt: skip
    """Move decode row `row`'s position fields one token on (`DecodeAdvance.apply`, for one row)."""
    nxt = tl.load(pos_ptr + row) + 1
    tl.store(pos_ptr + row, nxt)
    tl.store(spos_ptr + row, nxt + 1)
    tl.store(qs_ptr + row, nxt.to(tl.int32))
    tl.store(rc_ptr + row, nxt.to(tl.int32))
    tl.store(rp_ptr + row, nxt.to(tl.int32))
    ring = tl.load(slots_ptr + row).to(tl.int64) * window + nxt % window
    tl.store(rs_ptr + row, ring)
    tl.store(rd_ptr + row, ring)
    page = nxt // page_size
    inside = page < width
    at = tl.load(table_ptr + row.to(tl.int64) * width + page, mask=inside, other=0).to(tl.int64)
    tl.store(full_ptr + row, tl.where(inside, at * page_size + nxt % page_size, -1))
