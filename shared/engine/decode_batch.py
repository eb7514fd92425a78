"""Decode batches built incrementally: a steady-state decode step costs the host a few numpy ops.

Between two decode steps almost nothing changes: the same requests sit in the same rows, each one
position further on. `ForwardBatch.build` (the general path, every prefill and replay step) walks
every token and every page of every request in Python and packs them anew, which at batch 64 with a
graph's wide block table is far more host time than the step's launch. Here:

- the rows (one request each) are laid out once per composition: slots, padding rows, `cu_q`,
  `last_index`, and the block table, one gather by slot from the engine's `PageTable`;
- each step writes only what moves with the position (positions, `q_start`, ring context and
  positions, the page and ring store indices), vectorized over the rows;
- the packed layout is `ForwardBatch.build`'s (`I32_FIELDS`, `I64_FIELDS`); into a CUDA graph's
  static buffers, when one fits, both go in one upload (one byte buffer, int64 fields first:
  `cuda_graph.packed_buffers`). While the rows and the page table stay the same the device already
  holds the block table, so the upload stops before it;
- a graph step moves its rows on to the next position itself and takes their next inputs from the
  token table (`shared/kernels/decode_advance.py`): the next step on the same rows, one token
  further, with every input in the table, uploads nothing.

An input id of -1 is a token the step in flight is still producing: the forward takes it from the
token table on the device (`shared/kernels/token_table.py`). Results do not change: the batch is value
for value what `ForwardBatch.build` packs for the same requests (tests/engine/test_engine_decode.py
compares them through admit, finish, abort and slot reuse). Host buffers are plain memory; each upload
goes through a fresh pinned staging copy from torch's caching host allocator, which does not hand a
block out again before its copy has run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from shared.engine.batch import I32_FIELDS, I64_FIELDS, ForwardBatch, Mode, packed_sizes
from shared.engine.cuda_graph import DecodeGraphs
from shared.engine.host_copy import to_device
from shared.engine.kv.cache import KVCache
from shared.engine.kv.page_table import PageTable
from shared.engine.request import Request

__all__ = ["DecodeBatcher"]


class _Layout:
    """Host buffers packed as `ForwardBatch.build` packs a decode batch of `size` rows with a block
    table `width` pages wide. Shared by every composition of that shape: each upload copies them out,
    so nothing still reads them when the next composition rewrites them."""

    def __init__(self, size: int, width: int) -> None:
        s32, s64 = packed_sizes(size, size, size, width)
        o32, o64 = [0, *np.cumsum(s32).tolist()], [0, *np.cumsum(s64).tolist()]
        # One byte buffer, int64 fields first, as a graph's static buffers (`cuda_graph.packed_buffers`).
        self.bytes64 = 8 * o64[-1]
        self.raw = np.zeros(self.bytes64 + 4 * o32[-1], dtype=np.uint8)
        self.h64 = self.raw[: self.bytes64].view(np.int64)
        self.h32 = self.raw[self.bytes64 :].view(np.int32)
        self.f32 = {name: self.h32[o32[i] : o32[i + 1]] for i, name in enumerate(I32_FIELDS)}
        self.f64 = {name: self.h64[o64[i] : o64[i + 1]] for i, name in enumerate(I64_FIELDS)}
        self.table = self.f32["block_table"].reshape(size, width)
        self.prefix32 = o32[-2]  # the int32 values before the block table
        # q_start, ring_context, ring_pos: the rows' starts; ring_store, ring_dst: their ring indices
        at = I32_FIELDS.index("q_start")
        self.starts32 = self.h32[o32[at] : o32[at + 3]].reshape(3, size)
        at = I64_FIELDS.index("ring_store")
        self.ring64 = self.h64[o64[at] : o64[at + 2]].reshape(2, size)
        self.f32["cu_q"][:] = np.arange(size + 1)  # one token a row, whatever the rows
        self.f64["last_index"][:] = np.arange(size)


@dataclass(eq=False)
class _Rows:
    """One decode composition: its requests in row order and what it was laid out from. The object
    itself is the token a graph's `resident` keeps for the rows it uploaded."""

    reqs: list[Request]
    slots: np.ndarray  # [n] int64
    layout: _Layout
    version: int  # the page table's
    graphs: DecodeGraphs | None
    static: ForwardBatch | None  # the graph batch these rows are uploaded into; None: eager
    # The positions of the rows' next step if it follows the last one built, one token further: where
    # the graph step has moved its inputs (`shared/kernels/decode_advance.py`)
    next_starts: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Rows, padding included."""
        return self.layout.table.shape[0]


class DecodeBatcher:
    def __init__(self, cache: KVCache, table: PageTable) -> None:
        self.cache, self.table = cache, table
        self.window = cache.ring_len
        self._rows: _Rows | None = None
        self._layouts: dict[tuple[int, int], _Layout] = {}

    def build(
        self, reqs: list[Request], graphs: DecodeGraphs | None, tokens: list[int] | None
    ) -> ForwardBatch:
        """One decode token for each of `reqs` at position `num_scheduled`, fed `tokens` (-1: from the
        token table; None: every row's input is in the table)."""
        rows = self._rows
        same = rows is not None and rows.reqs == reqs and rows.graphs is graphs
        if not same or rows.version != self.table.version:
            rows = self._rows = self._compose(reqs, graphs)
        n, lay, f64 = len(reqs), rows.layout, rows.layout.f64
        starts = np.array([r.num_scheduled for r in reqs], dtype=np.int64)
        lay.starts32[:, :n] = starts
        f64["input_ids"][:n] = -1 if tokens is None else tokens
        f64["positions"][:n] = starts
        ps = self.cache.page_size
        f64["full_store"][:n] = self.table.table[rows.slots, starts // ps] * ps + starts % ps
        lay.ring64[:, :n] = rows.slots * self.window + starts % self.window
        f64["sample_positions"][:n] = starts + 1
        moved = rows.next_starts is not None and np.array_equal(starts, rows.next_starts)
        rows.next_starts = starts + 1
        if rows.static is not None:
            assert graphs is not None
            return self._upload_static(rows, graphs, advanced=moved and tokens is None)
        dev = self.cache.device
        buf32, buf64 = _upload(lay.h32, None, dev), _upload(lay.h64, None, dev)
        width = lay.table.shape[1]
        return ForwardBatch.from_packed(
            Mode.DECODE, buf32, buf64, rows=n, tokens=n, ring=n, width=width, max_q=1, num_real=n
        )

    def _compose(self, reqs: list[Request], graphs: DecodeGraphs | None) -> _Rows:
        """Lay out new rows: their slots, block table and padding; what never moves with a step."""
        n, pt = len(reqs), self.table
        slots = np.array([r.slot for r in reqs], dtype=np.int64)
        most = int(pt.num_pages[slots].max()) if n else 0
        size = graphs.size_for(n, most) if graphs is not None else None
        width = graphs.max_pages if size is not None and graphs is not None else max(most, 1)
        lay = self._layout(size or n, width)
        scratch, f32, f64 = self.cache.scratch_slot, lay.f32, lay.f64
        for name in ("token_slots", "slots"):
            f32[name][:n] = slots
            f32[name][n:] = scratch
        common = min(width, pt.width)
        lay.table[:n, :common] = pt.table[slots, :common]
        # Padding rows: one token at position 0 on the scratch slot, no pages, nothing stored, and
        # -1 ring positions, so the scratch ring stays empty.
        lay.table[n:] = 0
        lay.starts32[:, n:] = 0
        f32["ring_pos"][n:] = -1
        for name in ("input_ids", "positions", "sample_positions"):
            f64[name][n:] = 0
        f64["full_store"][n:] = -1
        f64["ring_store"][n:] = -1
        f64["ring_dst"][n:] = scratch * self.window
        static = None
        if size is not None and graphs is not None:
            static = replace(graphs.static[size], num_real=n)
        return _Rows(reqs, slots, lay, pt.version, graphs, static)

    def _layout(self, size: int, width: int) -> _Layout:
        lay = self._layouts.get((size, width))
        if lay is None:
            if len(self._layouts) >= 32:  # eager batches come in many widths: keep the cache small
                self._layouts.clear()
            lay = self._layouts[(size, width)] = _Layout(size, width)
        return lay

    def _upload_static(self, rows: _Rows, graphs: DecodeGraphs, *, advanced: bool) -> ForwardBatch:
        """One copy into the graph's static buffers (int64 fields, then int32 ones), the block table,
        last, only when the device lacks it. None at all when the buffers hold these rows, which the
        step before moved on to exactly this step's positions with every input in the token table
        (`advanced`)."""
        assert rows.static is not None
        raw, lay = graphs.raw[rows.size], rows.layout
        ours = graphs.resident[rows.size] is rows
        if advanced and ours:
            return rows.static
        end = lay.bytes64 + 4 * (lay.prefix32 if ours else len(lay.h32))
        _upload(lay.raw[:end], raw[:end], raw.device)
        graphs.resident[rows.size] = rows
        return rows.static


def _upload(host: np.ndarray, into: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Copy `host` into `into`, or into a new tensor on `device`, without blocking the host. On CUDA
    through a pinned copy: its block is not reused before the transfer has run, so `host` may be
    rewritten for the next step at once."""
    src = torch.from_numpy(host)
    if device.type != "cuda" and into is None:
        return src.clone()  # `host` is rewritten next step
    return to_device(src, device, into)
