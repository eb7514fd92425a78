"""`pdserve.v1.Prefill` on grpc.aio: Handshake, Prefill (stream the KV chunks) and GetModelInfo.

Every Prefill first compares the caller's KV layout with this service's, as Handshake does: a decode
that handshook with an earlier process on this address (restarted with another page size, window, ...)
or with another pod behind the same name gets FAILED_PRECONDITION naming every mismatching field before
any work, never KV it would misread. Then Prefill validates the prompt and sampling as Generate does
(the first token is sampled here), submits to the scheduler and waits for its `Prefilled` event, whose
chunks are CPU bytes already released from the pool. With a `cuda_ipc` target there are no chunks:
the scheduler has enqueued the writes into decode's pool and PrefillDone carries the event that says
when they are done. With a `nixl` target decode's agent is loaded first (once per agent, off the
scheduler thread) and PrefillDone comes only once the scheduler's WRITE is complete. A cancelled call
aborts the request if it is still computing, and otherwise just drops the bytes (or, nixl, lets the
WRITE end before the pages are freed).

`cached_tokens` (decode's prefix cache holds the full layers' KV of positions [0, cached_tokens)) is
checked here, at the edge: a multiple of the page size and shorter than the prompt, else
INVALID_ARGUMENT naming the field. Every backend then ships the full layers from there on only, and
PrefillDone echoes that position (`full_from`) for decode to check.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from prefill_service.scheduler import Prefilled, PrefillOpts, PrefillScheduler
from shared.model import LoadedModel
from shared.pb.pdserve.v1 import generation_pb2 as gen_pb
from shared.pb.pdserve.v1 import prefill_pb2 as pb
from shared.pb.pdserve.v1 import prefill_pb2_grpc as pb_grpc
from shared.serving.api.errors import FieldViolation, InvalidRequest
from shared.serving.api.model_info import model_info
from shared.serving.api.validation import Limits, validate_generate
from shared.serving.request_trace import RequestTrace, transfer_attrs
from shared.serving.runtime import ready
from shared.serving.scheduler_base import AlreadyExists, Finished, NotAccepting, QueueFull, SubmitError
from shared.serving.telemetry import Telemetry
from shared.transfer.base import KVLayout, mismatches
from shared.transfer.cuda_ipc import IpcTarget, IpcUnavailable, PoolExport
from shared.transfer.nixl import NixlError, NixlPool, NixlTarget, NixlUnavailable
from shared.transfer.nixl_ranks import pools_of

__all__ = ["BACKENDS", "SERVICE_NAME", "PrefillServicer", "PrefillServing"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Prefill"].full_name
_PREFILL = f"{SERVICE_NAME}/Prefill"
BACKENDS = ("inline", "cuda_ipc", "nixl")
_NIXL_PROBE_S = 10.0  # how long a handshake waits for its probe write into decode's agent

_SUBMIT_CODES: dict[type[SubmitError], grpc.StatusCode] = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    NotAccepting: grpc.StatusCode.UNAVAILABLE,
}


@dataclass(frozen=True)
class PrefillServing:
    loaded: LoadedModel
    scheduler: PrefillScheduler
    limits: Limits
    layout: KVLayout


def _check_cached_tokens(cached: int, prompt_tokens: int, page_size: int) -> None:
    """Decode's prefix-cache hit must end at a page boundary inside the prompt (its last token is
    computed here: its logits give the first token)."""
    why = []
    if cached % page_size:
        why.append(f"must be a multiple of the page size {page_size}, got {cached}")
    if cached >= prompt_tokens:
        why.append(f"must be less than the prompt's {prompt_tokens} tokens, got {cached}")
    if why:
        raise InvalidRequest([FieldViolation("cached_tokens", "; ".join(why))])


async def _refuse_mismatch(context: grpc.aio.ServicerContext, problems: list[str]) -> None:
    if problems:
        msg = "KV layout mismatch (decode != prefill): " + "; ".join(problems)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, telemetry: Telemetry | None = None) -> None:
        self.serving: PrefillServing | None = None  # set by the server once the model is loaded
        self.telemetry = telemetry or Telemetry("prefill")  # no tracer, no metrics unless given

    async def Handshake(
        self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandshakeResponse:
        s = await ready(context, self.serving)
        problems = mismatches(KVLayout.from_pb(request.layout), s.layout)
        if request.backend and request.backend not in BACKENDS:
            problems.append(f"backend: {request.backend!r} not in {list(BACKENDS)}")
        if request.backend == "cuda_ipc" and not problems:
            problems += await self._map_pool(s, request)
        await _refuse_mismatch(context, problems)
        if request.backend == "nixl":
            unreachable = await self._probe_agent(s, request)
            if unreachable:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, unreachable)
        return pb.HandshakeResponse(layout=s.layout.to_pb(), backend=request.backend or BACKENDS[0])

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillResponse]:
        s = await ready(context, self.serving)
        if request.HasField("layout"):
            await _refuse_mismatch(context, mismatches(KVLayout.from_pb(request.layout), s.layout))
        else:
            await _refuse_mismatch(context, ["layout: missing from the PrefillRequest"])
        sampling = gen_pb.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens = 1  # only the first token is sampled here
        del sampling.stop[:]  # stop strings are decode's (it detokenizes)
        gen = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=request.prompt), sampling=sampling)
        try:
            prompt, params = validate_generate(gen, s.limits, None)
            _check_cached_tokens(request.cached_tokens, len(prompt), s.layout.page_size)
        except InvalidRequest as e:
            await context.abort_with_status(e.to_status())
        # Decode's ids are unique per decode only: a suffix keeps two decodes' requests apart here.
        rid = f"{request.request_id or 'prefill'}/{uuid.uuid4().hex[:8]}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()

        def emit(ev: Any) -> None:  # on the scheduler thread
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(events.put_nowait, ev)

        target = IpcTarget.from_pb(request.cuda_ipc) if request.HasField("cuda_ipc") else None
        nixl = NixlTarget.from_pb(request.nixl) if request.HasField("nixl") else None
        if nixl is not None:
            await self._connect_agent(s, nixl.pool, context)
        if target is not None:
            if time.time_ns() >= target.lease_deadline_ns:  # decode may be reusing those pages already
                msg = "the cuda_ipc write lease expired before the request arrived"
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, msg)
            await self._ensure_mapped(s, target.pool, context)
        opts = PrefillOpts(
            request.send_window_history, request.max_chunk_bytes, target, nixl, request.cached_tokens
        )
        backend = "cuda_ipc" if target is not None else "nixl" if nixl is not None else "inline"
        attrs = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": s.loaded.name,
            "gen_ai.response.id": request.request_id,
            "pdserve.prefill.request_id": rid,
            "pdserve.window_history": request.send_window_history,
            "pdserve.prefix_cache.decode_hit_tokens": request.cached_tokens,
        }
        rt = RequestTrace(self.telemetry, rid, _PREFILL, context.invocation_metadata(), attrs)
        try:
            s.scheduler.submit(rid, prompt, params, emit, opts)
        except SubmitError as e:
            rt.fail(_SUBMIT_CODES[type(e)], str(e))
            await context.abort(_SUBMIT_CODES[type(e)], str(e))
        finished = False
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Prefilled) and ev.error is not None:
                    finished = True  # nothing was written; the pool no longer holds it
                    code = grpc.StatusCode[ev.error[0]]
                    rt.fail(code, ev.error[1], len(prompt))
                    await context.abort(code, ev.error[1])
                if isinstance(ev, Prefilled):
                    finished = True  # the pool no longer holds it: only these bytes (or writes) are left
                    self._phases(rt, ev, len(prompt), backend)
                    rt.set_attributes({"pdserve.prefix_cache.hit_tokens": ev.hit_tokens})
                    start = time.time_ns()
                    if ev.staged is not None:  # inline: each chunk's bytes copied as it is reached
                        fault = s.scheduler.faults
                        for i, chunk in enumerate(ev.staged.chunks(ev.max_chunk_bytes)):
                            yield (chunk if fault is None else fault.sent_chunk(prompt, i, chunk)).response()
                    # Recorded before the last message: once decode has it, it cancels the call, and
                    # this generator may not run past the yield.
                    end = time.time_ns()
                    nbytes = ev.full_bytes + ev.window_bytes
                    dur = max(end - start, 1) / 1e9
                    attrs = transfer_attrs(backend, "send", nbytes, dur)
                    attrs.update(
                        {"pdserve.kv.full_bytes": ev.full_bytes, "pdserve.kv.window_bytes": ev.window_bytes}
                    )
                    rt.child("kv.transfer", start, end, attrs)
                    if self.telemetry.metrics is not None:
                        self.telemetry.metrics.transfer(backend, "send", nbytes, dur)
                    rt.finish("length", len(prompt), 1)
                    done = pb.PrefillDone(
                        first_token=ev.first_token, full_bytes=ev.full_bytes, window_bytes=ev.window_bytes,
                        queued_prompt_tokens=ev.queued_tokens, cuda_ipc_event=ev.cuda_ipc_event,
                        cuda_ipc_rank_events=list(ev.cuda_ipc_rank_events),
                        full_from=ev.full_from, prefix_hit_tokens=ev.hit_tokens,
                    )  # fmt: skip
                    yield pb.PrefillResponse(done=done)
                    return
                if isinstance(ev, Finished):
                    finished = True
                    if ev.error is not None:
                        rt.fail(grpc.StatusCode.INTERNAL, ev.error, len(prompt))
                        await context.abort(grpc.StatusCode.INTERNAL, ev.error)
                    msg = "the prefill was aborted (server draining)"
                    rt.fail(grpc.StatusCode.ABORTED, msg, len(prompt))
                    await context.abort(grpc.StatusCode.ABORTED, msg)
        finally:
            if not finished:  # cancelled or past its deadline while computing: free its KV now
                s.scheduler.abort(rid)
            if not rt.ended:
                rt.fail(grpc.StatusCode.CANCELLED, "cancelled or past its deadline", len(prompt))

    @staticmethod
    async def _map_pool(s: PrefillServing, request: pb.HandshakeRequest) -> list[str]:
        """Map decode's pool now: a pool this process cannot reach fails the handshake, not a request."""
        if not request.HasField("cuda_ipc_pool"):
            return ["cuda_ipc_pool: missing (the cuda_ipc backend needs decode's pool export)"]
        try:
            await asyncio.to_thread(s.scheduler.map_ipc, PoolExport.from_pb(request.cuda_ipc_pool))
        except IpcUnavailable as e:
            return [f"cuda_ipc: {e}"]
        return []

    @staticmethod
    async def _ensure_mapped(s: PrefillServing, pool: PoolExport, context: grpc.aio.ServicerContext) -> None:
        """Decode's pool mapped before the request is queued: a prefill that restarted, or one of several
        behind round_robin, sees the pool first here, and mapping it (a driver call per pool tensor) must
        not stall the scheduler thread. One it cannot map answers FAILED_PRECONDITION, as at handshake."""
        try:
            if not s.scheduler.ipc_mapped(pool):
                await asyncio.to_thread(s.scheduler.map_ipc, pool)
        except IpcUnavailable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cuda_ipc: {e}")

    @staticmethod
    async def _probe_agent(s: PrefillServing, request: pb.HandshakeRequest) -> str:
        """Load decode's NIXL agent and write into its probe buffer; why not, or "" when it worked."""
        if not request.HasField("nixl_pool"):
            return "nixl_pool: missing (the nixl backend needs decode's agent metadata and pool)"
        pool = NixlPool.from_pb(request.nixl_pool)
        try:
            writer = await asyncio.to_thread(s.scheduler.nixl_writer)
            for each in pools_of(pool):  # a decode of several ranks: each rank's agent
                await asyncio.to_thread(writer.probe, each, _NIXL_PROBE_S)
        except NixlUnavailable as e:
            return f"nixl: this prefill service cannot use NIXL: {e}"
        except ValueError as e:
            return f"nixl: decode's pool does not fit this prefill's: {e}"
        except NixlError as e:
            return f"nixl: cannot reach decode's NIXL agent {pool.agent_name}: {e}"
        return ""

    @staticmethod
    async def _connect_agent(s: PrefillServing, pool: NixlPool, context: grpc.aio.ServicerContext) -> None:
        """Decode's agent loaded before any work. A prefill that cannot use NIXL, or whose pool differs,
        answers FAILED_PRECONDITION (decode prefills the request itself and re-handshakes); one that cannot
        reach the agent, UNAVAILABLE."""
        try:
            writer = s.scheduler.made_nixl_writer()
            for each in pools_of(pool):  # a decode of several ranks: each rank's agent
                if writer is None or not writer.connected(each.agent_name):  # the agent is made, or loaded:
                    writer = await asyncio.to_thread(s.scheduler.nixl_writer)  # not on the event loop
                    await asyncio.to_thread(writer.connect, each)
        except NixlUnavailable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"nixl: {e}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"nixl: decode's pool does not fit: {e}")
        except NixlError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"nixl: {e}")

    @staticmethod
    def _phases(rt: RequestTrace, ev: Prefilled, prompt_tokens: int, backend: str) -> None:
        """Queue, forward and extraction spans from the times the scheduler thread stamped."""
        rt.queued(ev.admitted_ns)
        rt.tokens(1)
        if ev.admitted_ns:
            rt.child(
                "prefill.forward",
                ev.admitted_ns,
                ev.computed_ns,
                {"gen_ai.usage.input_tokens": prompt_tokens},
            )
        if ev.computed_ns:
            # cuda_ipc: the writes enqueued; nixl: the WRITE, done
            rt.child("kv.extract", ev.computed_ns, ev.extracted_ns, {"pdserve.kv.backend": backend})

    async def GetModelInfo(
        self, request: gen_pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb.ModelInfo:
        s = await ready(context, self.serving)
        lay = s.layout
        return model_info(s.loaded, s.limits.max_context, lay.page_size, lay.dtype, s.scheduler.pool_state())
