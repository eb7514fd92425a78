"""The colocated Engine: add_request / step / generate. The reference the services are tested
against, and decode's local-prefill path.

    step():  schedule N+1 -> launch N+1 -> wait for N -> postprocess N

Overlap scheduling: the CPU builds and enqueues step N+1 while step N runs; a decode input that step
N is still producing is gathered on the device from N's output, so the one wait per step is for N's
tokens. A request that finishes at N may still be written by N+1: its pages and window are freed
only once N+1 has completed, never while the device may still write them.

Scheduling is prefill-first: waiting requests are admitted (window slot + pages for prompt and
max_tokens, all or nothing), prompts are computed in chunks under a token budget, and when no
prompt work is left every running request decodes one token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

import invariants
from shared.batch import ChunkItem, ForwardBatch, Mode
from shared.kv.allocator import OutOfCapacity
from shared.kv.cache import KVCache, KVConfig
from shared.kv.window import RequestWindow, replay_start
from shared.model.transformer import Transformer
from shared.request import Phase, Request
from shared.runner import ModelRunner
from shared.sampling import SamplingBatch, SamplingParams

__all__ = ["Engine", "EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    max_batch_tokens: int = 256  # prefill token budget per step (chunked prefill)
    max_running: int = 32
    overlap: bool = True  # prepare step N+1 while step N runs
    # Decode batch sizes captured as CUDA graphs on a CUDA device; () = eager only.
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


@dataclass
class _Step:
    """A launched forward whose tokens the host has not read yet."""

    reqs: list[Request]
    counts: list[int]  # tokens of row i whose K/V this step computes
    emits: list[bool]  # whether row i's token is an output token (decode, or a prompt's last chunk)
    tokens: torch.Tensor  # [B] on device
    host: torch.Tensor  # [B] pinned copy, valid once `ready` has completed
    ready: torch.cuda.Event | None
    releases: list[Request] = field(default_factory=list)  # freed once this step has completed


class Engine:
    def __init__(self, model: Transformer, kv: KVConfig, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.model_cfg = model.cfg
        self.cache = KVCache(model.cfg, kv)
        self.runner = ModelRunner(model, self.cache)
        self.checker = invariants.checker(self.cache.device)
        most = min(self.cfg.max_running, kv.max_requests)
        sizes = [b for b in self.cfg.cuda_graph_sizes if b <= most]
        if self.cache.device.type == "cuda" and sizes:
            self.runner.capture_decode_graphs(sizes, self.cache.pages_needed(self.max_context()))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._inflight: _Step | None = None
        self.held: set[Request] = set()  # reserved for a transfer in, or finished but held for one out
        self._sampling: SamplingBatch | None = None
        self._sampling_key: tuple[int, ...] = ()
        self._next_rid = 0

    # ---- requests ----

    def add_request(self, prompt: list[int], params: SamplingParams, *, hold_kv: bool = False) -> Request:
        """Queue a request. `hold_kv`: keep its KV after it finishes, for a transfer, until `release`."""
        req = self._new_request(prompt, params)
        req.hold_kv = hold_kv
        self.waiting.append(req)
        return req

    def reserve(self, prompt: list[int], params: SamplingParams) -> Request | None:
        """Disaggregated decode: pages and a window for a prompt whose KV another service computes.

        None when the pool cannot hold it now. Then `admit_prefilled` once the KV has arrived, or
        `release` if the transfer fails.
        """
        req = self._new_request(prompt, params)
        if not self._allocate(req):
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
        elif self._inflight is not None and req in self._inflight.reqs:
            self._inflight.releases.append(req)
        else:
            self._release(req)

    def _new_request(self, prompt: list[int], params: SamplingParams) -> Request:
        limit = self.max_context()
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < self.model_cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be in [0, {self.model_cfg.vocab_size})")
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                f"exceeds the context {limit}"
            )
        req = Request(self._next_rid, list(prompt), params)
        self._next_rid += 1
        return req

    def _allocate(self, req: Request) -> bool:
        need = self.cache.pages_needed(len(req.prompt) + req.params.max_tokens)
        if self.cache.slots.num_free == 0 or self.cache.pages.num_free < need:
            return False
        try:
            req.window = RequestWindow(self.cache, req.rid)
            req.pages = self.cache.pages.alloc(req.rid, need)
        except OutOfCapacity:
            self._release(req)
            return False
        return True

    def max_context(self) -> int:
        pool_tokens = self.cache.cfg.num_pages * self.cache.page_size if self.cache.full_layers else 1 << 62
        return min(self.model_cfg.max_position_embeddings, pool_tokens)

    def abort(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    @property
    def in_flight(self) -> bool:
        """A launched step has not been completed yet."""
        return self._inflight is not None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.held and self._inflight is None

    # ---- the loop ----

    def step(self) -> list[tuple[Request, int]]:
        """Launch the next forward and report the (request, token) pairs of the previous one."""
        self._admit()
        launched = self._launch(*self._schedule())
        done, self._inflight = self._inflight, launched
        produced = self._complete(done) if done is not None else []
        if not self.cfg.overlap and self._inflight is not None:
            now, self._inflight = self._inflight, None
            produced += self._complete(now)
        return produced

    def flush(self) -> list[tuple[Request, int]]:
        """Complete the step in flight without launching another (before a replay, at shutdown)."""
        done, self._inflight = self._inflight, None
        return self._complete(done) if done is not None else []

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while not all(r.finished for r in reqs) or self._inflight is not None:
            self.step()
        return reqs

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

    # ---- steps of step() ----

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            if not self._allocate(req):
                return
            self.waiting.popleft()
            req.phase = Phase.PREFILL
            req.admitted_ns = time.time_ns()  # once per request, not per step
            self.running.append(req)

    def _schedule(self) -> tuple[list[ChunkItem], list[Request], list[bool], Mode]:
        budget = self.cfg.max_batch_tokens
        items: list[ChunkItem] = []
        reqs: list[Request] = []
        emits: list[bool] = []
        for req in self.running:
            if req.num_scheduled < len(req.prompt) and budget > 0:
                start = req.num_scheduled
                n = min(len(req.prompt) - start, budget)
                items.append(ChunkItem(req.slot, start, req.prompt[start : start + n], req.pages))
                reqs.append(req)
                emits.append(start + n == len(req.prompt))
                budget -= n
        if items:
            return items, reqs, emits, Mode.EXTEND
        for req in self.running:
            if req.num_scheduled >= len(req.prompt) and len(req.output) + req.pending < req.params.max_tokens:
                last = req.output[-1] if req.output else -1  # -1: still in flight, gathered on device
                items.append(ChunkItem(req.slot, req.num_scheduled, [last], req.pages))
                reqs.append(req)
                emits.append(True)
        return items, reqs, emits, Mode.DECODE

    def _launch(
        self, items: list[ChunkItem], reqs: list[Request], emits: list[bool], mode: Mode
    ) -> _Step | None:
        if not items:
            return None
        batch = self.runner.build_batch(items, mode)
        if mode is Mode.DECODE and self._inflight is not None:
            rows = {id(r): i for i, r in enumerate(self._inflight.reqs)}
            pairs = [(i, rows[id(r)]) for i, r in enumerate(reqs) if r.pending]
            batch.take_inputs_from(self._inflight.tokens, pairs)
        key = tuple(r.rid for r in reqs)
        if key != self._sampling_key:  # decode batches repeat their composition step after step
            self._sampling = SamplingBatch.build([r.params for r in reqs], self.cache.device)
            self._sampling_key = key
        sampling = self._sampling
        out = self.runner.forward(batch, sampling)
        for req, item, emit in zip(reqs, items, emits, strict=True):
            req.num_scheduled += len(item.token_ids)
            req.pending += emit
        host = out.tokens
        if out.tokens.is_cuda:
            host = torch.empty(out.tokens.shape, dtype=out.tokens.dtype, pin_memory=True)
            host.copy_(out.tokens, non_blocking=True)
            out.ready.record()  # after the copy: completion means the host copy is readable
        counts = [len(item.token_ids) for item in items]
        return _Step(reqs, counts, emits, out.tokens, host, out.ready)

    def _complete(self, step: _Step) -> list[tuple[Request, int]]:
        if step.ready is not None:
            step.ready.synchronize()  # the step's one wait for the device
        tokens = step.host.tolist()
        for req in step.releases:
            self._release(req)
        self._contain(self.checker.poll())
        produced = []
        for req, count, emit, tok in zip(step.reqs, step.counts, step.emits, tokens, strict=True):
            req.num_computed += count
            if not emit:
                continue
            req.pending -= 1
            if req.finished:  # aborted or stopped while this step ran: its token is dropped
                continue
            req.phase = Phase.DECODE
            req.output.append(tok)
            produced.append((req, tok))
            self._maybe_finish(req, tok)
        return produced

    def _maybe_finish(self, req: Request, tok: int) -> None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.model_cfg.eos_token_ids):
            self._finish(req, "stop")
        elif len(req.output) >= p.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.phase, req.finish_reason = Phase.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        if req.hold_kv and reason != "abort":
            self.held.add(req)
            return  # a transfer still reads its KV: `release` frees it
        if self._inflight is not None and req in self._inflight.reqs:
            self._inflight.releases.append(req)  # the device may still write its KV
        else:
            self._release(req)

    def _release(self, req: Request) -> None:
        if req.pages:
            self.cache.pages.free(req.rid, req.pages)
            req.pages = []
        if req.window is not None:
            req.window.free()
            req.window = None

    def _contain(self, violations: list[invariants.Violation]) -> None:
        """At WARN, a FATAL_CONTAINABLE hit costs exactly the requests it names (by window slot)."""
        for v in violations:
            if v.severity is not invariants.Severity.FATAL_CONTAINABLE or not v.rows:
                continue
            hurt = set(v.rows)
            for req in list(self.running):
                if req.window is not None and req.slot in hurt:
                    req.error = f"invariant {v.name} violated ({v.severity.value}): request aborted"
                    self._finish(req, "abort")

    def check_idle_integrity(self) -> None:
        """Pool conservation: with nothing running, every page and slot is free."""
        self.cache.pages.check_integrity()
        self.cache.slots.check_integrity()
        if self.idle and (self.cache.pages.num_used or self.cache.slots.num_used):
            raise AssertionError(
                f"idle engine holds {self.cache.pages.num_used} pages and {self.cache.slots.num_used} slots"
            )
