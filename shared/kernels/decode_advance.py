"""A decode batch's rows moved on by one token, on the device: `advance_rows`.

A decode step on a CUDA graph reads its batch from the graph's static buffers. In steady decode (the
same requests in the same rows, each one token further) everything in them that changes between two
steps is a function of the position: so the graph's last kernel moves every real row's fields to the
next position itself, and marks its input id -1 (the token the step samples goes to the token table,
`token_table.py`). The next step on the same rows then uploads nothing. Whether it may skip the
upload is the host's decision (`shared/engine/decode_batch.py`): any other step uploads, and the
upload overwrites what was moved here.

For a row at position p the fields become the host's for p + 1: position, q_start, ring_context and
ring_pos p + 1; sample position p + 2; ring index slot * W + (p + 1) mod W, where the key is stored and
whose position is written; page index table[row, (p + 1) // P] * P + (p + 1) mod P (-1 past the
table's width: nothing is stored). Rows on `skip_slot` (a graph's padding rows, on the cache's scratch
slot) are left as they are: they store nothing and keep the scratch ring empty. Every row's sample
position before the move goes to `sampled_at`: the sampler, which runs after the graph, reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from shared.kernels._launch import check_triton_device

__all__ = ["DecodeRows", "advance_rows", "advance_rows_reference"]

_BLOCK = 128


@dataclass(frozen=True)
class DecodeRows:
    """The fields of a decode batch of B one-token rows that move with the position (all on one device)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    sample_positions: torch.Tensor  # [B] int64
    q_start: torch.Tensor  # [B] int32
    ring_context: torch.Tensor  # [B] int32
    ring_pos: torch.Tensor  # [B] int32
    full_store: torch.Tensor  # [B] int64
    ring_store: torch.Tensor  # [B] int64
    ring_dst: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, width] int32, contiguous

    def check(self) -> None:
        rows = self.positions.shape[0]
        for f in fields(self):
            t = getattr(self, f.name)
            want = 2 if f.name == "block_table" else 1
            if t.dim() != want or t.shape[0] != rows or t.device != self.positions.device:
                raise ValueError(
                    f"DecodeRows: {f.name} must have {want} dims and {rows} rows on {self.positions.device}, "
                    f"got {tuple(t.shape)} on {t.device}"
                )
        if not self.block_table.is_contiguous():
            raise ValueError("DecodeRows: the block table must be contiguous (rows of its width)")


@triton.jit
def _advance_kernel(
    ids_ptr, pos_ptr, spos_ptr, qs_ptr, rc_ptr, rp_ptr, full_ptr, rs_ptr, rd_ptr, slots_ptr, table_ptr,
    at_ptr, rows, width, page_size, window, skip_slot, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(at_ptr + r, tl.load(spos_ptr + r, mask=r < rows), mask=r < rows)
    slot = tl.load(slots_ptr + r, mask=r < rows, other=skip_slot)
    live = (r < rows) & (slot != skip_slot)
    nxt = tl.load(pos_ptr + r, mask=live, other=0) + 1
    tl.store(ids_ptr + r, tl.full([BLOCK], -1, tl.int64), mask=live)
    tl.store(pos_ptr + r, nxt, mask=live)
    tl.store(spos_ptr + r, nxt + 1, mask=live)
    tl.store(qs_ptr + r, nxt.to(tl.int32), mask=live)
    tl.store(rc_ptr + r, nxt.to(tl.int32), mask=live)
    tl.store(rp_ptr + r, nxt.to(tl.int32), mask=live)
    ring = slot.to(tl.int64) * window + nxt % window
    tl.store(rs_ptr + r, ring, mask=live)
    tl.store(rd_ptr + r, ring, mask=live)
    page = nxt // page_size
    inside = live & (page < width)
    at = tl.load(table_ptr + r.to(tl.int64) * width + page, mask=inside, other=0).to(tl.int64)
    tl.store(full_ptr + r, tl.where(inside, at * page_size + nxt % page_size, -1), mask=live)


def advance_rows_reference(
    rows: DecodeRows, sampled_at: torch.Tensor, *, page_size: int, window: int, skip_slot: int
) -> None:
    """The torch version (CPU, and the oracle of the kernel's tests)."""
    sampled_at.copy_(rows.sample_positions)
    live = rows.slots != skip_slot
    nxt = rows.positions + 1

    def put(field: torch.Tensor, value: torch.Tensor) -> None:
        field.copy_(torch.where(live, value.to(field.dtype), field))

    put(rows.input_ids, torch.full_like(nxt, -1))
    put(rows.positions, nxt)
    put(rows.sample_positions, nxt + 1)
    for f in (rows.q_start, rows.ring_context, rows.ring_pos):
        put(f, nxt)
    ring = rows.slots.to(torch.int64) * window + nxt % window
    put(rows.ring_store, ring)
    put(rows.ring_dst, ring)
    width = rows.block_table.shape[1]
    page = nxt // page_size
    at = rows.block_table.gather(1, page.clamp(0, width - 1).unsqueeze(1)).squeeze(1).to(torch.int64)
    put(rows.full_store, torch.where(page < width, at * page_size + nxt % page_size, -1))


def advance_rows(
    rows: DecodeRows, *, page_size: int, window: int, skip_slot: int, backend: str = "auto"
) -> torch.Tensor:
    """Move every row not on `skip_slot` one token on, in place (see the module's docstring); returns
    the rows' sample positions from before the move. "auto": the kernel on CUDA, torch elsewhere;
    "triton" forces the kernel (the interpreter on CPU)."""
    rows.check()
    if page_size < 1 or window < 1:
        raise ValueError(f"advance_rows: page_size and window must be >= 1, got {page_size} and {window}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"advance_rows: backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    n = rows.positions.shape[0]
    sampled_at = torch.empty_like(rows.sample_positions)
    if backend == "torch" or (backend == "auto" and not rows.positions.is_cuda) or n == 0:
        advance_rows_reference(rows, sampled_at, page_size=page_size, window=window, skip_slot=skip_slot)
        return sampled_at
    check_triton_device("advance_rows", rows.positions.device)
    _advance_kernel[(triton.cdiv(n, _BLOCK),)](
        rows.input_ids, rows.positions, rows.sample_positions, rows.q_start, rows.ring_context,
        rows.ring_pos, rows.full_store, rows.ring_store, rows.ring_dst, rows.slots, rows.block_table,
        sampled_at, n, rows.block_table.shape[1], page_size, window, skip_slot, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return sampled_at
