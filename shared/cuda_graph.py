"""CUDA graphs of the decode forward (model, KV stores, attention, invariant checks, logits).

One graph per captured batch size, sharing one memory pool; a batch of B sequences replays the
smallest graph of at least B rows, its extra rows padded onto the KV cache's scratch slot (nothing
stored, positions written as -1, so the scratch ring stays empty and passes its history check).
Sampling stays outside: its kernels depend on the batch's parameters. Invariant levels are frozen
at capture.
"""

from __future__ import annotations

import bisect
from dataclasses import fields
from typing import TYPE_CHECKING

import torch

from shared.batch import ForwardBatch, Mode

if TYPE_CHECKING:
    from shared.runner import ModelRunner

__all__ = ["DecodeGraphs"]

# Per-row fields copied from the live batch into the static one each replay, with their padding.
_ROW_FIELDS = {
    "input_ids": 0, "positions": 0, "token_slots": None, "q_start": 0, "ring_context": 0, "slots": None,
    "full_store": -1, "ring_store": -1, "ring_dst": None, "ring_pos": -1, "sample_positions": 0,
}  # fmt: skip


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, batch_sizes: list[int], max_pages: int) -> None:
        cache = runner.cache
        if cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the KV cache on a CUDA device")
        self.sizes = sorted(set(batch_sizes))
        self.max_pages = max_pages
        n, dev = self.sizes[-1], cache.device
        scratch, w = cache.scratch_slot, max(cache.window, 1)
        pad = {"token_slots": scratch, "slots": scratch, "ring_dst": scratch * w}
        i32 = ("token_slots", "q_start", "ring_context", "slots", "ring_pos")
        # Static inputs, already holding the padding; a replay overwrites the first B rows.
        self.static = {
            name: torch.full((n,), pad.get(name, value), device=dev,
                             dtype=torch.int32 if name in i32 else torch.int64)
            for name, value in _ROW_FIELDS.items()
        }  # fmt: skip
        self.static["block_table"] = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.static["cu_q"] = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.static["last_index"] = torch.arange(n, dtype=torch.int64, device=dev)
        self.pad_rows = {name: t.clone() for name, t in self.static.items()}
        self._rows_used = {size: size for size in self.sizes}  # rows a graph's last replay filled
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                batch = self._view(size)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture: compile, allocate
                    runner.forward_logits(batch)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = runner.forward_logits(batch)
                self.graphs[size] = (graph, logits)

    def _view(self, size: int) -> ForwardBatch:
        s = self.static
        rows = {name: s[name][:size] for name in _ROW_FIELDS}
        return ForwardBatch(
            mode=Mode.DECODE, num_seqs=size, num_tokens=size, max_q=1, cu_q=s["cu_q"][: size + 1],
            block_table=s["block_table"][:size], last_index=s["last_index"][:size], **rows,
        )  # fmt: skip

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Replay for `batch` (a DECODE batch); None when no captured size fits it."""
        b = batch.num_seqs
        i = bisect.bisect_left(self.sizes, b)
        if i == len(self.sizes) or batch.block_table.shape[1] > self.max_pages:
            return None
        size = self.sizes[i]
        graph, logits = self.graphs[size]
        s = self.static
        stale = self._rows_used[size]  # rows [b, stale) hold a previous batch: pad them again
        for name in _ROW_FIELDS:
            s[name][:b].copy_(getattr(batch, name))
            if stale > b:
                s[name][b:stale].copy_(self.pad_rows[name][b:stale])
        self._rows_used[size] = b
        width = batch.block_table.shape[1]
        s["block_table"][:b, :width].copy_(batch.block_table)
        graph.replay()
        return logits[:b]


assert {f.name for f in fields(ForwardBatch)} >= set(_ROW_FIELDS), "ForwardBatch fields drifted"
