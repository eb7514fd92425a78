"""ForwardBatch: everything one forward needs, built on the host by the scheduler, copied once.

Tokens of B sequences are flattened ([T], varlen). Each item is a chunk: `count` tokens of one
request starting at position `start`, its KV pages and its window slot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from shared.engine.host_copy import to_device
from shared.engine.kv.cache import KVCache
from shared.engine.kv.window import ring_store_index

__all__ = ["I32_FIELDS", "I64_FIELDS", "ChunkItem", "ForwardBatch", "Mode", "packed_sizes"]


class Mode(enum.Enum):
    EXTEND = "extend"  # prefill chunks (any length), KV stored
    DECODE = "decode"  # one token per sequence
    REPLAY = "replay"  # rebuild sliding rings: full layers read their pages only, rings start empty


@dataclass(frozen=True)
class ChunkItem:
    slot: int  # the request's window slot: a stable id for attribution
    start: int  # position of the chunk's first token (= tokens already in the cache)
    token_ids: list[int]
    pages: list[int]


@dataclass
class ForwardBatch:
    mode: Mode
    num_seqs: int
    num_tokens: int
    max_q: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_slots: torch.Tensor  # [T] int32: the slot of each token's sequence
    cu_q: torch.Tensor  # [B+1] int32
    q_start: torch.Tensor  # [B] int32
    ring_context: torch.Tensor  # [B] int32: tokens each ring must already hold (0 in replay)
    slots: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    full_store: torch.Tensor  # [T] int64 flat page index, -1 = don't store
    ring_store: torch.Tensor  # [T] int64 flat ring index, -1 = not among the chunk's last W
    ring_dst: torch.Tensor  # [N] int64 flat ring indices written this step
    ring_pos: torch.Tensor  # [N] int32 the positions they now hold
    last_index: torch.Tensor  # [B] int64 index in T of each sequence's last token
    sample_positions: torch.Tensor  # [B] int64 position of the token each sequence samples next
    num_real: int = -1  # rows that are real sequences (the rest pad a CUDA graph); -1 = all
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # the packed int32/int64 storage
    # EXTEND: leading rows of one token each (a mixed step's decodes, or any one-token chunk that comes
    # first) ahead of longer chunks; attention runs them apart, as a decode, instead of padding each
    # to the longest chunk.
    decode_rows: int = 0

    def __post_init__(self) -> None:
        if self.num_real < 0:
            self.num_real = self.num_seqs

    @classmethod
    def from_packed(
        cls, mode: Mode, buf32: torch.Tensor, buf64: torch.Tensor, *, rows: int, tokens: int, ring: int,
        width: int, max_q: int, num_real: int,
    ) -> ForwardBatch:  # fmt: skip
        """The batch whose fields are views of two packed buffers laid out as `packed_sizes` says."""
        s32, s64 = packed_sizes(rows, tokens, ring, width)
        i32 = dict(zip(I32_FIELDS, buf32.split(s32), strict=True))
        i64 = dict(zip(I64_FIELDS, buf64.split(s64), strict=True))
        i32["block_table"] = i32["block_table"].view(rows, width)
        return cls(
            mode=mode, num_seqs=rows, num_tokens=tokens, max_q=max_q, num_real=num_real,
            buffers=(buf32, buf64), **i32, **i64,
        )  # fmt: skip

    @classmethod
    def build(
        cls, items: list[ChunkItem], mode: Mode, cache: KVCache, *, pad_to: int | None = None,
        table_width: int | None = None, into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ForwardBatch:  # fmt: skip
        """Pack `items` for one forward. For a CUDA graph: `pad_to` rows (padding rows are one-token
        sequences on the cache's scratch slot that store nothing and leave its ring empty), a fixed
        `table_width`, and `into` the graph's static buffers (one copy each, no allocation).

        The general path (any mode, any chunk lengths): Python lists over every token and page. A
        steady-state decode step takes `shared/engine/decode_batch.py` instead, which must pack the same."""
        ps, w = cache.page_size, cache.ring_len
        ids: list[int] = []
        pos: list[int] = []
        tok_slot: list[int] = []
        cu = [0]
        full_store: list[int] = []
        ring_store: list[int] = []
        ring_dst: list[int] = []
        ring_vals: list[int] = []
        max_pages = table_width or max(len(it.pages) for it in items)
        table = [it.pages + [0] * (max_pages - len(it.pages)) for it in items]
        for it in items:
            n = len(it.token_ids)
            base = len(ids)
            ids += it.token_ids
            pos += range(it.start, it.start + n)
            tok_slot += [it.slot] * n
            if mode is Mode.REPLAY:
                full_store += [-1] * n
            else:
                full_store += [it.pages[p // ps] * ps + p % ps for p in range(it.start, it.start + n)]
            offsets, flat = ring_store_index(it.slot, it.start, n, w)
            row = [-1] * n
            for off, dst in zip(offsets, flat, strict=True):
                row[off] = dst
            ring_store += row
            ring_dst += flat
            ring_vals += [it.start + off for off in offsets]
            cu.append(base + n)
        starts = [it.start for it in items]
        slots = [it.slot for it in items]
        num_real = len(items)
        for _ in range((pad_to or num_real) - num_real):
            scratch = cache.scratch_slot
            ids.append(0)
            pos.append(0)
            tok_slot.append(scratch)
            full_store.append(-1)
            ring_store.append(-1)
            ring_dst.append(scratch * w)
            ring_vals.append(-1)
            cu.append(len(ids))
            starts.append(0)
            slots.append(scratch)
            table.append([0] * max_pages)
        rows = len(starts)
        sample_positions = [it.start + len(it.token_ids) for it in items] + [0] * (rows - num_real)
        buf32 = _upload(cache.device, torch.int32, [
            tok_slot, cu, slots, starts, [0] * rows if mode is Mode.REPLAY else starts, ring_vals,
            [p for row in table for p in row],
        ], into and into[0])  # fmt: skip
        buf64 = _upload(cache.device, torch.int64, [
            ids, pos, full_store, ring_store, ring_dst, [c - 1 for c in cu[1:]], sample_positions,
        ], into and into[1])  # fmt: skip
        batch = cls.from_packed(
            mode, buf32, buf64, rows=rows, tokens=len(ids), ring=len(ring_dst), width=max_pages,
            max_q=max([len(it.token_ids) for it in items] + [1]), num_real=num_real,
        )  # fmt: skip
        if mode is Mode.EXTEND and batch.max_q > 1:
            batch.decode_rows = next((i for i, it in enumerate(items) if len(it.token_ids) != 1), 0)
        return batch


# The packed order of each buffer's fields. The block table comes last: a decode step whose rows did
# not change can upload the int32 fields before it and leave the table on the device as it was. In a
# decode batch q_start, ring_context and ring_pos all hold the rows' starts, as do ring_store and
# ring_dst their ring indices: side by side, each set is written in one vectorized op.
I32_FIELDS = ("token_slots", "cu_q", "slots", "q_start", "ring_context", "ring_pos", "block_table")
I64_FIELDS = (
    "input_ids", "positions", "full_store", "ring_store", "ring_dst", "last_index", "sample_positions"
)  # fmt: skip


def packed_sizes(rows: int, tokens: int, ring: int, width: int) -> tuple[list[int], list[int]]:
    """Lengths of the int32 and int64 fields, in packed order, for `rows` sequences of `tokens` tokens
    in all, `ring` ring stores and a block table `width` pages wide."""
    return [tokens, rows + 1, rows, rows, rows, ring, rows * width], [tokens] * 4 + [ring, rows, rows]


def _upload(
    device: torch.device, dtype: torch.dtype, fields: list[list[int]], into: torch.Tensor | None
) -> torch.Tensor:
    """All fields of one dtype in one host buffer and one (pinned, non-blocking) copy."""
    flat = torch.tensor([v for values in fields for v in values], dtype=dtype)
    if into is not None and into.shape != flat.shape:
        raise ValueError(f"static buffer holds {into.numel()} values, this batch packs {flat.numel()}")
    return to_device(flat, device, into)
