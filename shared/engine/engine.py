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
`shared/engine/decode_batch.py`. Who owns the KV (allocation, deferred frees, and the reserve /
admit_prefilled / hold_kv / release / rebuild_window the services use to hand it between
processes): `shared/engine/kv_ownership.py`. This file runs the loop and owns each request's lifecycle.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import invariants
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.decode_batch import DecodeBatcher
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.kv.page_table import PageTable
from shared.engine.kv_ownership import KVOwnership
from shared.engine.request import Phase, Request
from shared.engine.runner import ModelRunner, on_device
from shared.engine.sampling import SamplingBatch, SamplingParams
from shared.engine.schedule import Plan, admit, schedule
from shared.model import gemm_tuning
from shared.model.transformer import Transformer

__all__ = ["Engine", "EngineConfig"]

# Prompt lengths `Engine.warm_up` runs: one in each power-of-two bucket of a chunk's query tile (tiles
# cap at 64 query rows), and one of several key tiles.
WARM_UP_LENGTHS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 1000)


@dataclass(frozen=True)
class EngineConfig:
    max_batch_tokens: int = 256  # token budget per step: the decodes' tokens, then prompt chunks
    max_running: int = 32
    overlap: bool = True  # prepare step N+1 while step N runs
    # Decode in every step beside prompt chunks (bounds the wait between two tokens to one step), or
    # (False) prompt chunks alone while any prompt has work, then decode.
    mixed: bool = False
    # Decode batch sizes captured as CUDA graphs on a CUDA device; () = eager only.
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    # Decode steps apply RoPE and store the K/V inside the attention kernels: one kernel a layer fewer,
    # -1.2% a step at batch 64 and -2.6% at batch 1 on the H200 (docs/benchmarks.md, "RoPE inside
    # decode attention"). On a CPU the torch ops do RoPE, the store and attention in turn: the same.
    rope_in_attention: bool = True
    # On CUDA, each layer's RMSNorm weights are multiplied into the GEMM weights after them once
    # (`Transformer.fold_norms`: it changes the model the engine is given): the residual adds go into
    # the o and down projections' GEMMs, the row scales into attention and the SwiGLU kernel, and a
    # layer runs no norm kernel (docs/benchmarks.md, "The norms folded"). On a CPU the model is left
    # as it is.
    fold_norms: bool = True
    # On CUDA, before the decode graphs are captured: each decode GEMM that goes to cuBLAS takes the
    # fastest of cuBLASLt's algorithms for its shape, timed on the model's weights, where it beats
    # torch's pick by 2% (`shared/model/gemm_tuning.py`; needs nvmath-python, the gpu extra). False
    # forgets earlier engines' choices on the same model: torch's GEMMs.
    tune_gemms: bool = True


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
    fed: torch.Tensor | None = None  # `ForwardOutput.fed`: a graph's input ids holding `tokens`


class Engine(KVOwnership):
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
        self.page_table = PageTable(kv.max_requests + 1, max_pages)  # + the scratch slot's empty row
        self.decoder = DecodeBatcher(self.cache, self.page_table)
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
        self._freeing: list[Request] | None = None  # see KVOwnership._free_kv
        self._finished_kv: list[Request] = []  # freed by a completion, after its tokens went out
        self.held: set[Request] = set()  # KVOwnership's: reserved for a transfer in, or held for one out
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
            and not self.held
            and self._inflight is None
            and not self._finished_kv
        )

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
        self.free_finished()
        admit(self.waiting, self.running, self.cfg.max_running, self._allocate_kv)
        launched = self._launch(schedule(self.running, self.cfg.max_batch_tokens, self.cfg.mixed))
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
        self.free_finished()
        return produced

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while not all(r.finished for r in reqs) or self._inflight is not None:
            self.step()
        self.free_finished()
        return reqs

    def warm_up(self, *, force: bool = False) -> float:
        """Compile, before any traffic, what the first requests would otherwise compile mid-step.

        Triton compiles a kernel on its first launch with each set of launch constants: the query
        tile a chunk's length picks, decode's tiles or prefill's, a mode flag. Each takes ~1 s, and
        every request in flight waits on it (on an H200, the serving trace's first pass spent 5.7 s
        of 8.6 in three such steps; `bench/engine_trace.py`). Throwaway greedy requests: each
        query-tile length alone, all of them together, and a prompt that arrives while another
        decodes (a mixed step, if `cfg.mixed`); and one seeded sampled request, for the sampler's
        kernels. Everything they held is freed after.
        CUDA only (nothing compiles on a CPU) unless `force`. Returns the seconds it took.
        """
        if self.cache.device.type != "cuda" and not force:
            return 0.0
        if not self.idle:
            raise RuntimeError("warm up an engine before its first request")
        start = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        room = self.max_context() - params.max_tokens
        lengths = [n for n in WARM_UP_LENGTHS if n <= room]
        for n in lengths:
            self.generate([[0] * n], params)
        self.generate([[0] * n for n in lengths[: self.cfg.max_running]], params)
        # A sampled row: the sampler's argmax over float32 scores is a kernel variant of its own on CUDA
        # (greedy rows take it over the model's dtype). Seeded: the engine's generator is not drawn from.
        self.generate([[0] * lengths[0]], dataclasses.replace(params, temperature=1.0, seed=0))
        longer = dataclasses.replace(params, max_tokens=8)
        fits = [n for n in lengths if n + longer.max_tokens <= self.max_context()]
        if fits:
            first = self.add_request([0] * fits[len(fits) // 2], longer)
            while not first.output and not first.finished:  # an abort (a contained violation) ends it
                self.step()
            self.generate([[0] * lengths[-1]], params)
            while not first.finished or self.in_flight:
                self.step()
        self.free_finished()
        self.check_idle_integrity()
        return time.perf_counter() - start

    # ---- steps of step() ----

    def _launch(self, plan: Plan) -> InFlightStep | None:
        reqs = plan.reqs
        if not reqs:
            return None
        if plan.mode is Mode.DECODE:
            batch = self._decode_batch(reqs, self._inflight)
            counts = [1] * len(reqs)
        else:
            batch = self.runner.build_batch(plan.items, plan.mode)
            counts = [len(item.token_ids) for item in plan.items]
            if self._inflight is not None:  # a mixed step's decode rows come first: row i is token i
                batch.take_inputs_from(self._inflight.tokens, _pending_rows(reqs, self._inflight))
        if reqs != self._sampling_reqs:  # decode batches repeat their composition step after step
            self._sampling = SamplingBatch.build([r.params for r in reqs], self.cache.device)
            self._sampling_reqs = reqs
        out = self.runner.forward(batch, self._sampling)
        for req, count, emit in zip(reqs, counts, plan.emits, strict=True):
            req.num_scheduled += count
            req.pending += emit
        host = out.host_tokens if out.host_tokens is not None else out.tokens
        return InFlightStep(reqs, counts, plan.emits, out.tokens, host, out.ready, fed=out.fed)

    def _decode_batch(self, reqs: list[Request], prev: InFlightStep | None) -> ForwardBatch:
        """One token for each request. An input the step in flight is still producing is gathered
        on the device from its output; in the steady state (the same rows as the step in flight)
        row i's input is simply its output i, so nothing about the inputs is built on the host."""
        steady = prev is not None and prev.reqs == reqs and all(prev.emits)
        # -1: a token still in flight, gathered on the device below
        tokens = None if steady else [r.output[-1] if r.output and not r.pending else -1 for r in reqs]
        # Steady greedy steps on a graph: the argmax of the step in flight writes its tokens into the
        # graph's input ids itself, so they are neither uploaded nor copied (one op less a step).
        fed = prev.fed if steady and prev is not None else None
        batch = self.decoder.build(reqs, self.runner.graphs, tokens, fed=fed)
        if prev is not None and (fed is None or batch.input_ids is not fed):
            batch.take_inputs_from(prev.tokens, None if steady else _pending_rows(reqs, prev))
        return batch

    def _complete(self, step: InFlightStep) -> list[tuple[Request, int]]:
        if step.ready is not None:
            step.ready.synchronize()  # the step's one wait for the device
        tokens = step.host.tolist()
        self._freeing = []
        try:
            return self._emit(step, tokens)
        finally:  # freed after the caller has the tokens: the next step(), or free_finished()
            freeing, self._freeing = self._freeing, None
            self._finished_kv += freeing

    def _emit(self, step: InFlightStep, tokens: list[int]) -> list[tuple[Request, int]]:
        for req in step.releases:
            self._free_kv(req)
        self._contain(self.checker.poll())
        produced = []
        finished, decode = Phase.FINISHED, Phase.DECODE  # once, not per row: this loop runs per token
        for req, count, emit, tok in zip(step.reqs, step.counts, step.emits, tokens, strict=True):
            req.num_computed += count
            if not emit:
                continue
            req.pending -= 1
            if req.phase is finished:  # aborted or stopped while this step ran: its token is dropped
                continue
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
            self.held.add(req)  # a transfer still reads its KV: `release` frees it
        else:
            self._free_kv_when_safe(req)

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


def _pending_rows(reqs: list[Request], prev: InFlightStep) -> list[tuple[int, int]]:
    """(row in `reqs`, row in `prev`) of each request whose input token `prev` is still producing."""
    rows = {id(r): i for i, r in enumerate(prev.reqs)}
    return [(i, rows[id(r)]) for i, r in enumerate(reqs) if r.pending]
