"""KV ownership: the one place a request's pages and window are allocated and freed, and the
operations the services use to move a request's KV between processes.

    colocated:     admit allocates                 -> finish frees
    prefill side:  add_request(hold_kv=True)       -> finish holds -> transfer reads -> release frees
    decode side:   reserve allocates -> transfer writes -> admit_prefilled (or release frees)
                   -> finish frees; rebuild_window when the sliding-window history did not arrive

A free never happens under a step in flight that may still write the request's KV: it waits in that
step's `releases` until the step has completed (`_free_kv_when_safe`). What a completion frees is
given back after step() has returned that step's tokens (`free_finished`).

A mixin of Engine, not an object of its own: reserve/admit_prefilled/release move requests between
the engine's queues and its step in flight, on the scheduler thread, and the services call them as
Engine methods. What it uses of the Engine is annotated on the class; `held` is its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.kv.allocator import OutOfCapacity
from shared.engine.kv.window import RequestWindow, free_windows, replay_start
from shared.engine.request import Phase, Request
from shared.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from shared.engine.engine import InFlightStep
    from shared.engine.kv.cache import KVCache
    from shared.engine.kv.page_table import PageTable
    from shared.engine.runner import ModelRunner
    from shared.model.config import ModelConfig

__all__ = ["KVOwnership"]


class KVOwnership:
    # The Engine's, used here.
    cache: KVCache
    page_table: PageTable  # every slot's pages, for decode batches: kept by allocation and free here
    runner: ModelRunner
    model_cfg: ModelConfig
    running: list[Request]
    _inflight: InFlightStep | None
    _freeing: list[Request] | None  # requests freed during a step's completion, freed at its end
    _finished_kv: list[Request]  # what completions freed, once step() has returned their tokens
    idle: bool
    abort: Callable[[Request], None]
    _new_request: Callable[[list[int], SamplingParams], Request]
    _maybe_finish: Callable[[Request, int], None]
    # Owned here: reserved for a transfer in, or finished but held for a transfer out.
    held: set[Request]

    def reserve(self, prompt: list[int], params: SamplingParams) -> Request | None:
        """Disaggregated decode: pages and a window for a prompt whose KV another service computes.

        None when the pool cannot hold it now. Then `admit_prefilled` once the KV has arrived, or
        `release` if the transfer fails.
        """
        req = self._new_request(prompt, params)
        if not self._allocate_kv(req):
            return None
        req.phase = Phase.RESERVED
        req.admitted_ns = time.time_ns()
        self.held.add(req)
        return req

    def admit_prefilled(self, req: Request, first_token: int, *, history: bool = True) -> None:
        """Join continuous batching with the prompt's KV in place and its first token sampled.

        `history=False`: the sliding-window rings did not arrive; rebuild them by bounded replay.
        """
        if req.phase is not Phase.RESERVED:
            raise ValueError(f"request {req.rid} is {req.phase.value}, not reserved")
        self.held.discard(req)
        req.num_computed = req.num_scheduled = len(req.prompt)
        if not history:
            self.rebuild_window(req)
        req.phase = Phase.DECODE
        req.output.append(first_token)
        self.running.append(req)
        self._maybe_finish(req, first_token)

    def release(self, req: Request) -> None:
        """Free what a held (prefill side) or reserved (decode side) request owns; idempotent."""
        req.hold_kv = False
        self.held.discard(req)
        if req.phase is Phase.RESERVED:
            req.phase, req.finish_reason = Phase.FINISHED, "abort"
        if not req.finished:
            self.abort(req)
        else:
            self._free_kv_when_safe(req)

    def rebuild_window(self, req: Request) -> int:
        """Bounded replay: recompute the tokens the rings need and store their K/V. Returns how many."""
        assert req.window is not None and req.num_scheduled == req.num_computed, "request has work in flight"
        tokens = req.prompt + req.output
        end = req.num_computed
        start = replay_start(end, self.model_cfg.layer_types, self.cache.window)
        req.window.clear()
        if start == end:
            return 0
        item = ChunkItem(req.slot, start, tokens[start:end], req.pages)
        self.runner.forward(ForwardBatch.build([item], Mode.REPLAY, self.cache), None)
        return end - start

    def max_context(self) -> int:
        """The longest prompt + max_tokens served: model positions, and the pool if it pages any layer."""
        pool_tokens = self.cache.cfg.num_pages * self.cache.page_size if self.cache.full_layers else 1 << 62
        return min(self.model_cfg.max_position_embeddings, pool_tokens)

    def check_idle_integrity(self) -> None:
        """Pool conservation: with nothing running, every page and slot is free."""
        self.cache.pages.check_integrity()
        self.cache.slots.check_integrity()
        if self.idle and (self.cache.pages.num_used or self.cache.slots.num_used):
            raise AssertionError(
                f"idle engine holds {self.cache.pages.num_used} pages and {self.cache.slots.num_used} slots"
            )

    def free_finished(self) -> None:
        """Free what the completed steps finished. `step()` returns a step's tokens first and frees
        its finished requests' KV at the start of the next call (or here, or before any allocation):
        a batch that finishes together gives back thousands of pages, which its last tokens need not
        wait for. A caller that hands tokens on (a service's scheduler) calls this once it has."""
        reqs, self._finished_kv = self._finished_kv, []
        self._free_kv_now(reqs)

    def _allocate_kv(self, req: Request) -> bool:
        """A window slot and pages for prompt + max_tokens, all or nothing."""
        self.free_finished()  # capacity a completed step finished with is capacity
        need = self.cache.pages_needed(len(req.prompt) + req.params.max_tokens)
        if self.cache.slots.num_free == 0 or self.cache.pages.num_free < need:
            return False
        try:
            req.window = RequestWindow(self.cache, req.rid)
            req.pages = self.cache.pages.alloc(req.rid, need)
        except OutOfCapacity:
            self._free_kv(req)
            return False
        self.page_table.assign(req.window.slot, req.pages)
        return True

    def _free_kv_when_safe(self, req: Request) -> None:
        if self._inflight is not None and req in self._inflight.reqs:
            self._inflight.releases.append(req)  # the device may still write its KV
        else:
            self._free_kv(req)

    def _free_kv(self, req: Request) -> None:
        if self._freeing is not None:  # a step's completion: its frees happen together at its end
            self._freeing.append(req)
        else:
            self._free_kv_now([req])

    def _free_kv_now(self, reqs: list[Request]) -> None:
        """Give back what `reqs` own in one pass each over the page table, the pools and the rings: a
        batch finishing together frees thousands of pages (`UnitAllocator.free_many`)."""
        if not reqs:
            return
        reqs = list(dict.fromkeys(reqs))  # a request is freed once, however often it was asked for
        windows = [r.window for r in reqs if r.window is not None]
        self.page_table.clear([w.slot for w in windows])
        self.cache.pages.free_many([(r.rid, r.pages) for r in reqs])
        free_windows(self.cache, windows)
        for r in reqs:
            r.pages, r.window = [], None
