"""The colocated Engine: add_request / step / generate. The reference the services are tested
against, and decode's local-prefill path.

    step():  schedule -> run -> postprocess

Scheduling is prefill-first: waiting requests are admitted (window slot + pages for prompt and
max_tokens, all or nothing), prompts are computed in chunks under a token budget, and when no
prompt work is left every running request decodes one token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

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


class Engine:
    def __init__(self, model: Transformer, kv: KVConfig, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.model_cfg = model.cfg
        self.cache = KVCache(model.cfg, kv)
        self.runner = ModelRunner(model, self.cache)
        self.checker = invariants.checker(self.cache.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_rid = 0

    # ---- requests ----

    def add_request(self, prompt: list[int], params: SamplingParams) -> Request:
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
        self.waiting.append(req)
        return req

    def max_context(self) -> int:
        pool_tokens = self.cache.cfg.num_pages * self.cache.page_size if self.cache.full_layers else 1 << 62
        return min(self.model_cfg.max_position_embeddings, pool_tokens)

    def abort(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- the loop ----

    def step(self) -> list[tuple[Request, int]]:
        """One forward. Returns the (request, token) pairs it produced."""
        self._admit()
        items, reqs, mode = self._schedule()
        if not items:
            return []
        batch = ForwardBatch.build(items, mode, self.cache)
        sampling = SamplingBatch.build([r.params for r in reqs], self.cache.device)
        out = self.runner.forward(batch, sampling)
        tokens = out.tokens.tolist()  # the step's one wait for the device
        self._contain(self.checker.poll())
        return self._postprocess(reqs, items, tokens, mode)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    def rebuild_window(self, req: Request) -> int:
        """Bounded replay: recompute the tokens the rings need and store their K/V. Returns how many."""
        assert req.window is not None
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
            need = self.cache.pages_needed(len(req.prompt) + req.params.max_tokens)
            if self.cache.slots.num_free == 0 or self.cache.pages.num_free < need:
                return
            try:
                req.window = RequestWindow(self.cache, req.rid)
                req.pages = self.cache.pages.alloc(req.rid, need)
            except OutOfCapacity:
                if req.window is not None:
                    req.window.free()
                    req.window = None
                return
            self.waiting.popleft()
            req.phase = Phase.PREFILL
            self.running.append(req)

    def _schedule(self) -> tuple[list[ChunkItem], list[Request], Mode]:
        budget = self.cfg.max_batch_tokens
        items: list[ChunkItem] = []
        reqs: list[Request] = []
        for req in self.running:
            if req.phase is Phase.PREFILL and budget > 0:
                n = min(len(req.prompt) - req.num_computed, budget)
                start = req.num_computed
                items.append(ChunkItem(req.slot, start, req.prompt[start : start + n], req.pages))
                reqs.append(req)
                budget -= n
        if items:
            return items, reqs, Mode.EXTEND
        for req in self.running:
            if req.phase is Phase.DECODE:
                items.append(ChunkItem(req.slot, req.num_computed, [req.output[-1]], req.pages))
                reqs.append(req)
        return items, reqs, Mode.DECODE

    def _postprocess(
        self, reqs: list[Request], items: list[ChunkItem], tokens: list[int], mode: Mode
    ) -> list[tuple[Request, int]]:
        produced = []
        for req, item, tok in zip(reqs, items, tokens, strict=True):
            if req.finished:  # aborted by containment during this step
                continue
            req.num_computed += len(item.token_ids)
            if mode is Mode.EXTEND and req.num_computed < len(req.prompt):
                continue  # a partial chunk: its sample is not a token of the output
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
                    self._finish(req, "abort")

    def check_idle_integrity(self) -> None:
        """Pool conservation: with nothing running, every page and slot is free."""
        self.cache.pages.check_integrity()
        self.cache.slots.check_integrity()
        if self.idle and (self.cache.pages.num_used or self.cache.slots.num_used):
            raise AssertionError(
                f"idle engine holds {self.cache.pages.num_used} pages and {self.cache.slots.num_used} slots"
            )
