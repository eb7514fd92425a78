"""CUDA graphs of the decode step's body (input tokens, model, KV stores, attention, invariant checks,
logits, and the rows moved on to the next position: `ModelRunner.decode_body`).

One graph per captured batch size, sharing one memory pool. Each graph reads a ForwardBatch packed
in its own static buffers: the scheduler builds a decode batch of B sequences straight into the
buffers of the smallest graph of at least B rows (one host-to-device copy), padding the rest onto
the KV cache's scratch slot (nothing stored, positions written as -1, so the scratch ring stays
empty and passes its history check). Sampling stays outside: its kernels depend on the batch's
parameters. Invariant levels are frozen at capture.

On a CPU cache nothing is captured: the static buffers alone, on which `run` calls the body eagerly
(what tests and bench/engine_host.py use to run the graph path's host side without a GPU).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from shared.engine.batch import ForwardBatch, Mode, packed_sizes
from shared.engine.host_copy import reserve_pinned
from shared.engine.kv.cache import KVCache

__all__ = ["DecodeBody", "DecodeGraphs", "packed_buffers"]

# A decode step's body on a batch: (logits [B, V], the positions each row sampled at [B]).
DecodeBody = Callable[[ForwardBatch], tuple[torch.Tensor, torch.Tensor]]


def packed_buffers(
    rows: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw, int32 view, int64 view): a decode batch of `rows` one-token rows with a `width`-page block
    table packed in one byte buffer, its int64 fields first, then its int32 fields (block table last)."""
    s32, s64 = packed_sizes(rows, rows, rows, width)
    n64, n32 = sum(s64), sum(s32)
    raw = torch.zeros(8 * n64 + 4 * n32, dtype=torch.uint8, device=device)
    return raw, raw[8 * n64 :].view(torch.int32), raw[: 8 * n64].view(torch.int64)


class DecodeGraphs:
    def __init__(self, body: DecodeBody, cache: KVCache, batch_sizes: list[int], max_pages: int) -> None:
        self.body = body
        self.cache = cache
        self.sizes = sorted(set(batch_sizes))
        self.max_pages = max_pages
        self.static: dict[int, ForwardBatch] = {}
        # Each graph's static int64 and int32 fields are views of one byte buffer (int64 first), so a
        # decode step uploads them in one copy (`shared/engine/decode_batch.py`): every eager op between
        # two replays leaves a gap on the GPU's timeline.
        self.raw: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        # Whose rows each static buffer holds on the device: a token the decode batch builder
        # (`shared/engine/decode_batch.py`) leaves when it uploads, so that the steps after it on the
        # same rows can skip the block table, or the whole upload; None = nobody's yet.
        self.resident: dict[int, object | None] = dict.fromkeys(self.sizes)
        capture = self.cache.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if capture else None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            # Static buffers are built outside inference mode: later batches are copied into them
            # wherever the scheduler runs, and an inference tensor refuses in-place updates there.
            with torch.inference_mode(False):
                raw, buf32, buf64 = packed_buffers(size, max_pages, self.cache.device)
                batch = ForwardBatch.build(
                    [], Mode.DECODE, self.cache, pad_to=size, table_width=max_pages, into=(buf32, buf64)
                )
            self.static[size], self.raw[size] = batch, raw
            if not capture:
                continue
            # The cache's device, not the thread's current one (cuda:1 of a process that sees two GPUs):
            # streams, warm-up and capture must all be on the device the kernels run on.
            with torch.inference_mode(), torch.cuda.device(self.cache.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture: compile, allocate
                    body(batch)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # Our own capture stream: torch's default one is made once per process, on whichever
                # device captured first, and capturing on it would switch to that device.
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    outputs = body(batch)
                # A graph's first replay uploads it to the device, which would otherwise land on the
                # first decode step at that size. The static batch is all padding: nothing is stored.
                graph.replay()
                self.graphs[size] = (graph, outputs)

        if capture and self.raw:
            # Every decode step uploads its batch through a pinned staging block (`host_copy.to_device`):
            # the first step at the largest size would otherwise wait for one to be allocated.
            reserve_pinned(max(raw.numel() for raw in self.raw.values()))

    def size_for(self, rows: int, max_pages: int) -> int | None:
        """The smallest static batch of at least `rows` rows whose table holds `max_pages`; or None."""
        i = bisect.bisect_left(self.sizes, rows)
        if i == len(self.sizes) or max_pages > self.max_pages:
            return None
        return self.sizes[i]

    def holds(self, batch: ForwardBatch) -> bool:
        """Whether `batch` lives in a graph's static buffers (captured, or on a CPU cache, not)."""
        static = self.static.get(batch.num_seqs)
        return static is not None and batch.buffers is not None and batch.buffers[0] is static.buffers[0]

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The body on `batch` if a graph's static buffers hold it (replayed; eager on a CPU cache, where
        nothing is captured); None when they do not."""
        if not self.holds(batch):
            return None
        if batch.num_seqs not in self.graphs:
            return self.body(batch)
        graph, outputs = self.graphs[batch.num_seqs]
        graph.replay()
        return outputs
