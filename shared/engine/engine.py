"""The colocated Engine: add_request / step / generate. The reference the services are tested
against, and decode's local-prefill path.

    step():  free what N-1 finished -> admit + schedule N+1 -> launch N+1 -> wait for N -> postprocess N

Overlap scheduling: the CPU builds and enqueues step N+1 while step N runs; a decode input that step
N is still producing is gathered on the device from N's output, so the one wait per step is for N's
tokens. A request that finishes at N may still be written by N+1: its pages and window are freed
only once N+1 has completed, never while the device may still write them. What a step's completion
frees waits until after step() has returned that step's tokens (`free_finished`): a batch finishing
together frees thousands of pages, and its last tokens should not wait for that.

Who decides what runs (admission in arrival order, mixed steps of decode tokens and prompt chunks
under a token budget): `shared/engine/schedule.py`. How a decode step's batch is built without
redoing what the step before it built (a persistent page table, per-composition host buffers):
`shared/engine/decode_batch.py`. Who allocates and frees the KV: `shared/engine/kv_ownership.py`.
This file runs the loop and owns each request's lifecycle, including the reserve / admit_prefilled /
hold_kv / release / rebuild_window the services use to hand a request's KV between processes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

import invariants
from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.config import EngineConfig
from shared.engine.decode_batch import DecodeBatcher
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.kv.prefix_index import PrefixIndex
from shared.engine.kv.window import replay_start
from shared.engine.kv_ownership import KVOwnership
from shared.engine.request import Phase, Request
from shared.engine.runner import ModelRunner, on_device
from shared.engine.sampling import SamplingBatch, SamplingParams
from shared.engine.schedule import Plan, admit, schedule
from shared.engine.warm_up import warm_up
from shared.model import gemm_tuning
from shared.model.transformer import Transformer

__all__ = ["Engine", "EngineConfig", "Pending"]

T = TypeVar("T")


@dataclass
class InFlightStep:
    """A launched forward whose tokens the host has not read yet."""

    reqs: list[Request]
    counts: list[int]  # tokens of row i whose K/V this step computes
    emits: list[bool]  # whether row i's token is an output token (decode, or a prompt's last chunk)
    tokens: torch.Tensor  # [B] on device
    host: torch.Tensor  # [B] pinned copy, valid once `ready` has completed
    ready: torch.cuda.Event | None
    releases: list[Request] = field(default_factory=list)  # freed once this step has completed


_MISSING = object()


class Later:
    """An op's result that is not there when the op returns (a transfer still running). A follower
    keeps it, polls it between rank 0's calls and sends its value once `poll` has one; rank 0's own
    stays as it is in `Pending.results[0]`, for its caller to poll."""

    def poll(self) -> tuple[bool, Any]:
        """(True, the value) once there is one, else (False, None); never blocks."""
        raise NotImplementedError


class Pending:
    """The results of an `Engine.on_ranks_later` op, in rank order, as they arrive."""

    def __init__(self, results: list[Any]) -> None:
        self.results = results

    @property
    def done(self) -> bool:
        return all(r is not _MISSING for r in self.results)

    def missing(self, rank: int) -> bool:
        return self.results[rank] is _MISSING

    @staticmethod
    def awaiting(first: Any, others: int) -> Pending:
        """Rank 0's result, and `others` ranks' still to come."""
        return Pending([first] + [_MISSING] * others)


class Engine:
    def __init__(self, model: Transformer, kv: KVConfig, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.model_cfg = model.cfg
        self.cache = KVCache(model.cfg, kv)
        self.runner = ModelRunner(
            model,
            self.cache,
            rope_in_attention=self.cfg.rope_in_attention,
            fold_norms=self.cfg.fold_norms,
        )
        self.checker = invariants.checker(self.cache.device)
        max_pages = self.cache.pages_needed(self.max_context())
        prefix = None
        if self.cfg.prefix_cache and self.cache.full_layers:  # a model of sliding layers only pages nothing
            prefix = PrefixIndex(self.cache.page_size)
        self.kv = KVOwnership(self.cache, max_pages, prefix, replay_budget=self.cfg.max_batch_tokens)
        self.decoder = DecodeBatcher(self.cache, self.kv.page_table)
        most = min(self.cfg.max_running, kv.max_requests)
        sizes = [b for b in self.cfg.cuda_graph_sizes if b <= most]
        if self.cache.device.type == "cuda" and sizes:
            if self.cfg.tune_gemms:
                self.runner.tune_gemms(sizes)
            else:  # an earlier engine's choices on this model go too: torch's GEMMs
                gemm_tuning.clear(model)
            self.runner.capture_decode_graphs(sizes, max_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._inflight: InFlightStep | None = None
        self._sampling: SamplingBatch | None = None
        self._sampling_reqs: list[Request] = []  # the rows `_sampling` was built for
        self._next_rid = 0

    # ---- requests ----

    def add_request(self, prompt: list[int], params: SamplingParams, *, hold_kv: bool = False) -> Request:
        """Queue a request. `hold_kv`: keep its KV after it finishes, for a transfer, until `release`."""
        req = self._new_request(prompt, params)
        req.hold_kv = hold_kv
        self.waiting.append(req)
        return req

    def abort(self, req: Request) -> None:
        self._abort(req)

    def _abort(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    @property
    def in_flight(self) -> bool:
        """A launched step has not been completed yet."""
        return self._inflight is not None

    @property
    def idle(self) -> bool:
        return (
            not self.waiting
            and not self.running
            and not self.kv.held
            and self._inflight is None
            and not self.kv.owes
        )

    def _allocate(self, req: Request) -> bool:
        if not self.kv.allocate(req, share=self.kv.prefix is not None):
            return False
        if req.replay_from is not None:  # its hit needs its rings rebuilt: replayed now, then kept
            self._replay(req, req.replay_from, req.num_computed)
            req.replay_from = None
            self.kv.save_window(req, req.num_computed)
        return True

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
        eos = () if params.ignore_eos else self.model_cfg.eos_token_ids
        req.stop_ids = frozenset(params.stop_token_ids).union(eos)
        self._next_rid += 1
        return req

    # ---- the loop ----

    def step(self) -> list[tuple[Request, int]]:
        """Launch the next forward and report the (request, token) pairs of the previous one."""
        with on_device(self.cache.device):  # batch building launches kernels too
            return self._step()

    def _step(self) -> list[tuple[Request, int]]:
        self.kv.free_finished()
        admit(self.waiting, self.running, self.cfg.max_running, self._allocate)
        plan = schedule(self.running, self.cfg.max_batch_tokens, self.cfg.mixed)
        self._planned(plan)
        launched = self._launch(plan)
        done, self._inflight = self._inflight, launched
        produced = self._complete(done) if done is not None else []
        if not self.cfg.overlap and self._inflight is not None:
            now, self._inflight = self._inflight, None
            produced += self._complete(now)
        return produced

    def flush(self) -> list[tuple[Request, int]]:
        """Complete the step in flight without launching another (before a replay, at shutdown)."""
        done, self._inflight = self._inflight, None
        produced = self._complete(done) if done is not None else []
        self.kv.free_finished()
        return produced

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while not all(r.finished for r in reqs) or self._inflight is not None:
            self.step()
        self.kv.free_finished()
        return reqs

    def warm_up(self, *, force: bool = False) -> float:
        """Compile, before any traffic, what the first requests would otherwise compile mid-step
        (`shared/engine/warm_up.py`). CUDA only (nothing compiles on a CPU) unless `force`. Returns
        the seconds it took."""
        if self.cache.device.type != "cuda" and not force:
            return 0.0
        took = warm_up(self)
        self.kv.drop_cached()  # the warm-up's prompts are no one's prefix
        return took

    # ---- KV between processes (the services) ----

    @property
    def held(self) -> set[Request]:
        """Requests reserved for a transfer in, or finished but held for a transfer out."""
        return self.kv.held

    @property
    def max_running(self) -> int:
        return self.cfg.max_running

    def reserve(self, prompt: list[int], params: SamplingParams, *, share: bool = False) -> Request | None:
        """Disaggregated decode: pages and a window for a prompt whose KV another service computes.

        None when the pool cannot hold it now. Then `admit_prefilled` once the KV has arrived, or
        `release` if the transfer fails. `share`: the leading pages the prefix cache holds are read
        from there (`req.cached_tokens` of them): only the rest of the prompt's KV must arrive, into
        `req.pages[req.cached_tokens // page_size:]`.
        """
        req = self._new_request(prompt, params)
        if not self.kv.allocate(req, share=share and self.kv.prefix is not None, computes=False):
            return None
        req.phase = Phase.RESERVED
        req.admitted_ns = time.time_ns()
        self.kv.held.add(req)
        return req

    def admit_prefilled(self, req: Request, first_token: int, *, history: bool = True) -> None:
        """Join continuous batching with the prompt's KV in place and its first token sampled.

        `history=False`: the sliding-window rings did not arrive; rebuild them by bounded replay.
        """
        if req.phase is not Phase.RESERVED:
            raise ValueError(f"request {req.rid} is {req.phase.value}, not reserved")
        self.kv.held.discard(req)
        req.num_computed = req.num_scheduled = len(req.prompt)
        self.kv.cache_prompt(req)  # its prompt's KV is all here: later prompts may share it
        if not history:
            self._rebuild_window(req)
        req.phase = Phase.DECODE
        req.output.append(first_token)
        self.running.append(req)
        self._maybe_finish(req, first_token)

    def release(self, req: Request) -> None:
        """Free what a held (prefill side) or reserved (decode side) request owns; idempotent."""
        req.hold_kv = False
        self.kv.held.discard(req)
        if req.phase is Phase.RESERVED:
            req.phase, req.finish_reason = Phase.FINISHED, "abort"
        if not req.finished:
            self._abort(req)
        else:
            self._free_kv_when_safe(req)

    def rebuild_window(self, req: Request) -> int:
        """Bounded replay: recompute the tokens the rings need and store their K/V. Returns how many."""
        return self._rebuild_window(req)

    def _rebuild_window(self, req: Request) -> int:
        assert req.window is not None and req.num_scheduled == req.num_computed, "request has work in flight"
        end = req.num_computed
        start = replay_start(end, self.model_cfg.layer_types, self.cache.window)
        req.window.clear()
        self._replay(req, start, end)
        return end - start

    def _replay(self, req: Request, start: int, end: int) -> None:
        """Recompute positions [start, end) into `req`'s empty rings (its pages already hold them)."""
        if start < end:
            item = ChunkItem(req.slot, start, (req.prompt + req.output)[start:end], req.pages)
            self.runner.forward(ForwardBatch.build([item], Mode.REPLAY, self.cache), None)

    def max_context(self) -> int:
        """The longest prompt + max_tokens served: model positions, and the pool if it pages any layer."""
        c = self.cache
        pool_tokens = c.cfg.num_pages * c.page_size if c.full_layers else 1 << 62
        return min(self.model_cfg.max_position_embeddings, pool_tokens)

    def on_ranks(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """`fn(engine, *args)` on every rank's engine, in rank order: this engine's alone unless it is
        tensor parallel (`shared/engine/mirror.py`). How a transfer reads or writes each rank's share
        of a request's KV; a request among `args` is each rank's own."""
        pending = self.on_ranks_later(fn, *args)
        self.collect(pending, block=True)
        return pending.results

    def on_ranks_later(self, fn: Callable[..., Any], *args: Any) -> Pending:
        """`on_ranks` without waiting for the other ranks: their results arrive in the returned
        `Pending` (`collect`). This engine's own result is there at once."""
        return Pending([fn(self, *args)])

    def collect(self, pending: Pending, *, block: bool = False) -> bool:
        """Whether every rank's result of `pending` is in (`block`: wait until it is)."""
        return pending.done

    def close(self) -> None:
        """Release what outlives the Python objects (a tensor-parallel engine's other ranks)."""

    def check_idle_integrity(self) -> None:
        """Pool conservation: with nothing running, every page and slot is free."""
        self.kv.check_integrity(self.idle)

    def free_finished(self) -> None:
        """Free what the completed steps finished. `step()` returns a step's tokens first and frees
        its finished requests' KV at the start of the next call (or here, or before any allocation):
        a batch that finishes together gives back thousands of pages, which its last tokens need not
        wait for. A caller that hands tokens on (a service's scheduler) calls this once it has."""
        self.kv.free_finished()

    # ---- steps of step() ----

    def _launch(self, plan: Plan) -> InFlightStep | None:
        reqs = plan.reqs
        if not reqs:
            return None
        if plan.mode is Mode.DECODE:
            batch = self._decode_batch(reqs, self._inflight)
            counts = [1] * len(reqs)
        else:
            batch = ForwardBatch.build(plan.items, plan.mode, self.cache)
            counts = [len(item.token_ids) for item in plan.items]
        if reqs != self._sampling_reqs:  # decode batches repeat their composition step after step
            self._sampling = SamplingBatch.build([r.params for r in reqs], self.cache.device)
            self._sampling_reqs = reqs
        out = self.runner.forward(batch, self._sampling)
        for req, count, emit in zip(reqs, counts, plan.emits, strict=True):
            req.num_scheduled += count
            req.pending += emit
            if req.snapshot_at and req.num_scheduled in req.snapshot_at:
                self.kv.save_window(req, req.num_scheduled)  # after this step, before the next one
        host = out.host_tokens if out.host_tokens is not None else out.tokens
        return InFlightStep(reqs, counts, plan.emits, out.tokens, host, out.ready)

    def _decode_batch(self, reqs: list[Request], prev: InFlightStep | None) -> ForwardBatch:
        """One token for each request: the host's, or -1 for one the step in flight is still producing
        (the forward takes it from the token table). In the steady state (the same rows as the step in
        flight, all of them emitting) every input is in the table: nothing about the inputs is built
        on the host."""
        steady = prev is not None and prev.reqs == reqs and all(prev.emits)
        tokens = None if steady else [r.output[-1] if r.output and not r.pending else -1 for r in reqs]
        return self.decoder.build(reqs, self.runner.graphs, tokens)

    def _complete(self, step: InFlightStep) -> list[tuple[Request, int]]:
        if step.ready is not None:
            step.ready.synchronize()  # the step's one wait for the device
        tokens = step.host.tolist()
        with (
            self.kv.completing()
        ):  # freed after the caller has the tokens: the next step(), or free_finished()
            return self._emit(step, tokens)

    def _emit(self, step: InFlightStep, tokens: list[int]) -> list[tuple[Request, int]]:
        for req in step.releases:
            self.kv.free(req)
        self._contain(self._poll())
        produced = []
        finished, decode = Phase.FINISHED, Phase.DECODE  # once, not per row: this loop runs per token
        for req, count, emit, tok in zip(step.reqs, step.counts, step.emits, tokens, strict=True):
            req.num_computed += count
            if not emit:
                continue
            req.pending -= 1
            if req.phase is finished:  # aborted or stopped while this step ran: its token is dropped
                continue
            if req.phase is not decode and self.kv.prefix is not None:
                self.kv.cache_prompt(req)  # its prompt's KV is written: later prompts may share it
            req.phase = decode
            req.output.append(tok)
            produced.append((req, tok))
            if tok in req.stop_ids or len(req.output) >= req.params.max_tokens:
                self._maybe_finish(req, tok)
        return produced

    def _maybe_finish(self, req: Request, tok: int) -> None:
        if tok in req.stop_ids:
            self._finish(req, "stop")
        elif len(req.output) >= req.params.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.phase, req.finish_reason = Phase.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        if req.hold_kv and reason != "abort":
            self.kv.held.add(req)  # a transfer still reads its KV: `release` frees it
        else:
            self._free_kv_when_safe(req)

    def _free_kv_when_safe(self, req: Request) -> None:
        if self._inflight is not None and req in self._inflight.reqs:
            self._inflight.releases.append(req)  # the device may still write its KV
        else:
            self.kv.free(req)

    def _planned(self, plan: Plan) -> None:
        """What the next forward runs, just before it launches (a tensor-parallel engine's hook:
        shared/engine/mirror.py)."""

    def _poll(self) -> list[invariants.Violation]:
        """The invariant violations to contain after a step: this engine's checker's."""
        return self.checker.poll()

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
