"""`pdserve.v1.Generation` on grpc.aio: validate, hand to the scheduler, stream its events back.

The servicer never touches the engine: it holds a scheduler. The router (decode_service/routing.py)
says where each prompt is prefilled and why. A remote one: the scheduler reserves KV and emits Reserved,
this coroutine runs the Prefill call and hands each chunk to the scheduler thread, then lets it admit
the request. A call that fails has the scheduler prefill the request here instead, and the client sees a
normal completion (the route on its span says why): a layout refusal (FAILED_PRECONDITION), a full
prefill queue (RESOURCE_EXHAUSTED) or a prompt prefill cannot take (INVALID_ARGUMENT) computed nothing
there; a call that ran out of decode's time for it, could not reach prefill or broke off mid-stream also
opens that prefill replica's circuit (decode_service/routing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from decode_service.output import OutputProcessor
from decode_service.prefill_client import (
    PrefillBusy,
    PrefillFailed,
    PrefillMismatch,
    PrefillRefused,
    PrefillRejected,
    PrefillTimedOut,
)
from decode_service.routing import PrefillRouter, Route
from decode_service.scheduler import (
    AlreadyExists,
    DecodeScheduler,
    Event,
    Finished,
    NotAccepting,
    QueueFull,
    RemoteOpts,
    Reserved,
    SubmitError,
    Tokens,
)
from shared.engine.sampling import SamplingParams
from shared.model import LoadedModel
from shared.pb.pdserve.v1 import generation_pb2 as pb
from shared.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from shared.serving.api.errors import InvalidRequest
from shared.serving.api.model_info import model_info
from shared.serving.api.validation import Chat, Limits, validate_generate
from shared.serving.request_trace import RequestTrace, transfer_attrs
from shared.serving.runtime import ready
from shared.serving.security.guard import caller
from shared.serving.security.tokens import Identity
from shared.serving.telemetry import Telemetry
from shared.transfer.cuda_ipc import IpcTarget, PoolExport
from shared.transfer.nixl import NixlPool, NixlTarget

__all__ = ["SERVICE_NAME", "GenerationServicer", "Serving"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_GENERATE = f"{SERVICE_NAME}/Generate"
_PREFILL = "pdserve.v1.Prefill/Prefill"

_SUBMIT_CODES: dict[type[SubmitError], grpc.StatusCode] = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    NotAccepting: grpc.StatusCode.UNAVAILABLE,
}


@dataclass(frozen=True)
class Serving:
    """What exists once the model is loaded."""

    loaded: LoadedModel
    scheduler: DecodeScheduler
    limits: Limits
    page_size: int
    kv_dtype: str
    router: PrefillRouter = field(default_factory=lambda: PrefillRouter(None))  # where each prompt prefills
    window_history: bool = True


def _chunk(rid: str, token_ids: list[int], text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(token_ids=token_ids, text=text))


def _complete(rid: str, finish: Finished) -> pb.GenerateResponse:
    usage = pb.Usage(
        prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
        cached_prompt_tokens=finish.cached_tokens,
    )  # fmt: skip
    reason = finish.reason
    return pb.GenerateResponse(request_id=rid, complete=pb.Complete(finish_reason=reason, usage=usage))


def _route_attrs(route: Route) -> dict[str, str]:
    attrs = {"pdserve.prefill": route.where, "pdserve.prefill.reason": route.reason}
    if route.replica is not None:  # remote; a fallback (local) route names none: the span keeps the first
        attrs["pdserve.prefill.replica"] = route.replica.address
    return attrs


def _genai_attrs(model: str, rid: str, params: SamplingParams, route: Route, chat: bool) -> dict[str, Any]:
    return {
        "gen_ai.operation.name": "chat" if chat else "text_completion",
        "gen_ai.provider.name": "pdserve",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.response.id": rid,
        **_route_attrs(route),
    }


_DEADLINE_SLACK_S = 0.25
# A remote prefill that failed without a layout refusal: the route the request takes instead. Busy and
# rejected calls computed nothing; KV that did not start at decode's prefix-cache hit (prefix_mismatch)
# is dropped; any other failure (timed out, unreachable, a stream cut short) also opens the router's
# circuit.
_FALLBACK: dict[type[PrefillFailed], str] = {
    PrefillBusy: "prefill_busy",
    PrefillRejected: "prefill_rejected",
    PrefillTimedOut: "prefill_unavailable",
    PrefillMismatch: "prefix_mismatch",
}


def _ended_early(context: grpc.aio.ServicerContext, left: bool) -> tuple[str, grpc.StatusCode, str]:
    """Why a stream ended before its Complete: its deadline passed, the client cancelled (`left`: grpc
    cancelled the handler), or it failed."""
    remaining = context.time_remaining()
    # A client gives up at its own deadline, a moment before the server's copy of it runs out.
    if remaining is not None and remaining <= _DEADLINE_SLACK_S:
        return "deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "past its deadline"
    if left or context.cancelled():
        return "cancelled", grpc.StatusCode.CANCELLED, "cancelled by the client"
    return "error", grpc.StatusCode.UNKNOWN, "the stream failed"


async def _fail(
    context: grpc.aio.ServicerContext, rt: RequestTrace, code: grpc.StatusCode, msg: str, *usage: int
) -> None:
    rt.fail(code, msg, *usage)
    await context.abort(code, msg)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, telemetry: Telemetry | None = None) -> None:
        self.serving: Serving | None = None  # set by the server once the model is loaded
        self.telemetry = telemetry or Telemetry("decode")  # no tracer, no metrics unless given
        # Tokenization and chat templates run here, off the event loop: a long text must not stall
        # every other stream (and the health service) while it is encoded.
        self._tokenize = ThreadPoolExecutor(max_workers=2, thread_name_prefix="decode-tokenize")
        # Who started each running request (None: anonymous, no auth configured): Abort checks it.
        self._owners: dict[str, Identity | None] = {}

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        s = await ready(context, self.serving)
        tok = s.loaded.tokenizer
        # A prompt over the context is refused by its token count, before its ids are made.
        encode = functools.partial(tok.encode, max_tokens=s.limits.max_context) if tok is not None else None
        check = functools.partial(validate_generate, request, s.limits, encode, Chat.of(tok))
        try:
            prompt, params = await asyncio.get_running_loop().run_in_executor(self._tokenize, check)
        except InvalidRequest as e:
            await context.abort_with_status(e.to_status())
        rid = request.request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()

        def emit(ev: Event | Reserved) -> None:  # on the scheduler thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, ev)

        route = s.router.route(len(prompt), prompt)
        opts = RemoteOpts(s.window_history) if route.remote else None
        md = context.invocation_metadata()
        attrs = _genai_attrs(s.loaded.name, rid, params, route, request.HasField("messages"))
        rt = RequestTrace(self.telemetry, rid, _GENERATE, md, attrs)
        rt.decode_phase = True
        try:
            s.scheduler.submit(rid, prompt, params, emit, opts)
        except SubmitError as e:
            s.router.done(route)
            await _fail(context, rt, _SUBMIT_CODES[type(e)], str(e))
        self._owners[rid] = caller()
        out = OutputProcessor(tok, params.stop)
        done = False
        final = route  # where the prompt was prefilled in the end
        left = False  # grpc cancelled this handler: the client went away, or its deadline passed
        try:
            first: Any = None
            if route.remote:
                first = await events.get()
                if isinstance(first, Reserved):
                    rt.queued(first.at_ns)
                    reserved = first
                    call = self._remote_prefill(s, rid, prompt, request, context, rt, route, reserved)
                    final, first = await _unless_finished(call, events, route)
            while not done:
                batch = [first if first is not None else await events.get()]
                first = None
                while not events.empty():  # a client that lags gets fewer, larger chunks
                    batch.append(events.get_nowait())
                tokens = [t for ev in batch if not isinstance(ev, Finished) for t in ev.token_ids]
                finish = next((ev for ev in batch if isinstance(ev, Finished)), None)
                for ev in batch:
                    if isinstance(ev, Tokens) and ev.admitted_ns:
                        rt.queued(ev.admitted_ns)  # a local request's first tokens: its queue time ended
                rt.tokens(len(tokens))
                step = out.feed(tokens)
                text = step.text
                if step.stopped:
                    cached = finish.cached_tokens if finish is not None else 0
                    if s.scheduler.abort(rid):  # the engine may run a step more; those tokens are dropped
                        cached = await _ended(events)  # the id is free once it ends: the client may reuse it
                    finish = Finished("stop", len(prompt), out.num_tokens, cached_tokens=cached)
                elif finish is not None:
                    if finish.error is not None:
                        done = True  # the engine has already let it go
                        usage = (finish.prompt_tokens, finish.completion_tokens)
                        await _fail(context, rt, grpc.StatusCode.INTERNAL, finish.error, *usage)
                    text += out.flush()
                if step.token_ids or text:
                    yield _chunk(rid, step.token_ids, text)
                if finish is not None:
                    done = True
                    rt.set_attributes({"pdserve.prefix_cache.hit_tokens": finish.cached_tokens})
                    rt.finish(finish.reason, finish.prompt_tokens, finish.completion_tokens)
                    yield _complete(rid, finish)
        except asyncio.CancelledError:
            left = True
            raise
        finally:
            self._owners.pop(rid, None)
            s.router.done(route)  # a remote prefill that never ran (aborted while waiting for pages)
            if self.telemetry.metrics is not None:
                self.telemetry.metrics.prefill_route(final.where, final.reason)
            if not done:  # cancelled, past its deadline, or the stream failed: free its KV now
                s.scheduler.abort(rid)
            if not rt.ended:
                reason, code, why = _ended_early(context, left)
                rt.fail(code, why, len(prompt), reason=reason)

    async def _remote_prefill(
        self, s: Serving, rid: str, prompt: list[int], request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext, rt: RequestTrace, route: Route, reserved: Reserved,
    ) -> Route:  # fmt: skip
        """Run the Prefill call; returns where the prompt is prefilled in the end."""
        client = route.replica.client if route.replica is not None else None  # the replica routed to
        assert client is not None
        target: IpcTarget | NixlTarget | None = None
        if client.pool is not None:  # cuda_ipc, nixl: prefill writes into the reservation until the lease
            # nixl on CUDA, cuda_ipc with ranks: every rank's emptying of the rings runs before any write
            if reserved.settled is not None:
                while not reserved.settled.query():
                    await asyncio.sleep(0.0002)
            deadline = time.time_ns() + int(client.call_timeout(context.time_remaining()) * 1e9)
            s.scheduler.leased(rid, deadline)  # before the call: an abort from now on quarantines
            # Only the pages from the prefix-cache hit on: the ones before are shared, never written (a
            # prefill that ignores cached_tokens cannot reach them either).
            pages = reserved.pages[reserved.cached_tokens // s.page_size :]
            if isinstance(client.pool, PoolExport):
                target = IpcTarget(client.pool, pages, reserved.slot, reserved.ready_event, deadline)
            elif isinstance(client.pool, NixlPool):
                target = NixlTarget(client.pool, pages, reserved.slot, deadline)
        attrs = {
            "server.address": client.target, "pdserve.window_history": s.window_history,
            "pdserve.prefix_cache.decode_hit_tokens": reserved.cached_tokens,
        }  # fmt: skip
        refused: str | None = None
        fallback: tuple[str, str] | None = None  # (route reason, why): nothing usable came back
        metrics = self.telemetry.metrics
        with rt.client_call(_PREFILL, attrs) as (metadata, span):
            try:
                res = await client.prefill(
                    rid, prompt, request.sampling, s.window_history, context.time_remaining(),
                    lambda batches: s.scheduler.deliver(rid, batches), metadata, target,
                    reserved.cached_tokens,
                )  # fmt: skip
            except PrefillFailed as e:
                why = str(e) if isinstance(e, PrefillRefused) else f"prefill service {client.target}: {e}"
                if isinstance(e, PrefillRefused):
                    refused = why
                else:
                    fallback = (_FALLBACK.get(type(e), "prefill_unavailable"), why)
                if span is not None:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, why))
            else:
                s.router.done(route, res.queued_tokens)
                if span is not None:
                    span.set_attribute("pdserve.prefix_cache.prefill_hit_tokens", res.prefill_hit_tokens)
                if res.first_chunk_ns:
                    dur = max(res.done_ns - res.first_chunk_ns, 1) / 1e9
                    rt.child("kv.transfer", res.first_chunk_ns, res.done_ns, transfer_attrs(
                        client.backend, "receive", res.nbytes, dur), parent=span)  # fmt: skip
                    if metrics is not None:
                        metrics.transfer(client.backend, "receive", res.nbytes, dur)
        s.router.done(route)
        if refused is not None:  # nothing was computed there: the reservation is prefilled here
            s.router.refused(route, refused)
            local = Route(False, "prefill_mismatch")
            rt.set_attributes(_route_attrs(local))
            if metrics is not None:
                metrics.prefill_refused()
            s.scheduler.prefill_locally(rid)
            return local
        if fallback is not None:  # the client still waits for tokens: the prompt is computed here
            reason, why = fallback
            if reason == "prefill_unavailable":  # dead, hung or cut off: stop sending until it answers
                s.router.unavailable(route, why)
            local = Route(False, reason)
            rt.set_attributes(_route_attrs(local))
            # cuda_ipc, nixl: a call that timed out or broke may still write until its lease has passed;
            # cuda_ipc: a prefill that ignored cached_tokens may still be writing the reservation's own
            # pages (nixl's WRITE had ended before its PrefillDone).
            ipc_late = reason == "prefix_mismatch" and isinstance(target, IpcTarget)
            s.scheduler.prefill_locally(rid, written=reason == "prefill_unavailable" or ipc_late)
            return local
        s.scheduler.prefilled(rid, res.first_token, s.window_history, res.cuda_ipc_events)
        return route

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        s = await ready(context, self.serving)
        rid = request.request_id
        if rid in self._owners:
            owner, who = self._owners[rid], caller()
            if owner is not None and (who is None or (who.name != owner.name and not who.admin)):
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"request {rid[:80]!r} was started by another caller: only it or an admin may abort it",
                )
        return pb.AbortResponse(found=s.scheduler.abort(rid))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        s = await ready(context, self.serving)
        pool = s.scheduler.pool_state()
        return model_info(s.loaded, s.limits.max_context, s.page_size, s.kv_dtype, pool)


async def _ended(events: asyncio.Queue[Any], timeout: float = 10.0) -> int:
    """Wait for the scheduler's Finished of an aborted request (the tokens before it are dropped);
    returns its prompt tokens read from the prefix cache."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while not isinstance(ev := await events.get(), Finished):
                pass
            return ev.cached_tokens
    return 0


async def _unless_finished(
    prefill: Coroutine[Any, Any, Route], events: asyncio.Queue[Any], route: Route
) -> tuple[Route, Any]:
    """Run the remote prefill, unless the request ends first (an Abort by id, a drain): then cancel it,
    so that the client hears at once and the Prefill call is cancelled (prefill stops computing it).
    Returns where the prompt was prefilled and the event that came meanwhile (None if none did)."""
    task = asyncio.ensure_future(prefill)
    waiting = asyncio.ensure_future(events.get())
    try:
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        waiting.cancel()
        raise
    if task.done():
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            return task.result(), None
        return task.result(), waiting.result()
    event = waiting.result()
    if not isinstance(event, Finished):  # not an end: let the prefill finish, the event comes first
        return await task, event
    task.cancel()  # the request ended while its prompt was away: nothing of the call is needed
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return route, event
