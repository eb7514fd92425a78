"""One OpenAI generation over one gRPC `Generate` call: streamed as server-sent events or answered
whole, the call cancelled whenever the HTTP client goes away first (decode then frees the request's KV).

Disconnects: the handler awaits the call's output in a task raced against the ASGI `receive` channel,
which yields `http.disconnect` when the client closes the connection; once the response streams,
Starlette cancels the body iterator on disconnect. Either way, leaving without a `Complete` cancels
the gRPC call.

A stream's HTTP status is decided by its first event: the front waits for the first chunk (or the
call's failure) before sending headers, so a refused request is a 4xx/5xx like a non-streaming one,
not a 200 followed by an error event. Failures after that arrive as an error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import context, propagate

from shared.client.client import AsyncClient, AsyncStream, Chunk, GenerationError
from shared.client.openai.edge import state_t0
from shared.client.openai.errors import APIError, from_generation_error
from shared.client.openai.protocol import usage

__all__ = ["Generation", "run_generation"]

T = TypeVar("T")

_ABORTED = APIError(
    503, "the server aborted the request (draining or an engine fault); retry", "server_error", code="aborted"
)


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


@dataclass(frozen=True)
class Generation:
    """What differs between /v1/completions and /v1/chat/completions."""

    endpoint: str
    rid: str
    model: str
    stream: bool
    include_usage: bool
    gen_kwargs: dict[str, Any]  # AsyncClient.generate's arguments (prompt or messages, sampling)
    param_aliases: dict[str, str]  # gRPC field -> this request's parameter name
    whole: Callable[[str, str, dict[str, Any]], dict[str, Any]]  # (text, finish, usage) -> response
    chunk: Callable[[str | None, str | None], dict[str, Any]]  # (text, finish) -> stream chunk
    opening: dict[str, Any] | None = None  # a first stream chunk before any text (chat's role delta)


async def run_generation(
    request: Request, client: AsyncClient, g: Generation, ttft: Any, bearer: str | None = None
) -> Response:
    """Start the call under the caller's trace context and with their `bearer` token (None: no token),
    and answer with its result."""
    t0 = state_t0(request.scope)
    token = context.attach(propagate.extract(request.headers))  # W3C traceparent -> the gRPC metadata
    try:
        stream = client.generate(request_id=g.rid, token=bearer, **g.gen_kwargs)
    finally:
        context.detach(token)
    it = aiter(stream)
    try:
        if not g.stream:
            chunks = await _unless_disconnected(request, _collect(it, t0, ttft))
            return _whole(g, stream, chunks)
        first = await _unless_disconnected(request, _first_chunk(it, t0, ttft))
    except GenerationError as e:
        _cancel(stream)
        return from_generation_error(e, g.param_aliases).response()
    except ClientGone:
        _cancel(stream)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it, metrics do
    except BaseException:  # this handler cancelled (shutdown): end the call, decode frees the KV
        _cancel(stream)
        raise
    headers = {"x-request-id": g.rid, "cache-control": "no-cache"}
    return StreamingResponse(_events(g, stream, it, first), media_type="text/event-stream", headers=headers)


def _whole(g: Generation, stream: AsyncStream, chunks: list[Chunk]) -> Response:
    if stream.finish_reason == "abort" or stream.usage is None or stream.finish_reason is None:
        return _ABORTED.response()
    text = "".join(c.text for c in chunks)
    use = usage(*dataclasses.astuple(stream.usage))
    return JSONResponse(g.whole(text, stream.finish_reason, use), headers={"x-request-id": g.rid})


async def _collect(it: AsyncIterator[Chunk], t0: float, ttft: Any) -> list[Chunk]:
    chunks = []
    async for c in it:
        if not chunks:
            ttft.observe(time.perf_counter() - t0)
        chunks.append(c)
    return chunks


async def _first_chunk(it: AsyncIterator[Chunk], t0: float, ttft: Any) -> Chunk | None:
    """The first chunk; None when the call completed without one."""
    async for c in it:
        ttft.observe(time.perf_counter() - t0)
        return c
    return None


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for t in (task, watch):
            t.cancel()


async def _disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _cancel(stream: AsyncStream) -> None:
    if stream.finish_reason is None:  # no Complete yet: the call is still open on decode
        stream.cancel()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _events(
    g: Generation, stream: AsyncStream, it: AsyncIterator[Chunk], first: Chunk | None
) -> AsyncIterator[str]:
    """`data: {chunk}` events, the finish, the usage chunk if asked for, then `data: [DONE]`."""
    extra = {"usage": None} if g.include_usage else {}  # OpenAI: usage null on every chunk but the last
    try:
        if g.opening is not None:
            yield _sse(g.opening | extra)
        if first is not None and first.text:
            yield _sse(g.chunk(first.text, None) | extra)
        async for c in it:
            if c.text:  # token ids alone (text held back for a stop string) make no event
                yield _sse(g.chunk(c.text, None) | extra)
        if stream.finish_reason in (None, "abort") or stream.usage is None:
            yield _sse(_ABORTED.body())
        else:
            yield _sse(g.chunk("", stream.finish_reason) | extra)
            if g.include_usage:
                use = usage(
                    stream.usage.prompt_tokens,
                    stream.usage.completion_tokens,
                    stream.usage.cached_prompt_tokens,
                )
                yield _sse(g.chunk(None, None) | {"usage": use})
    except GenerationError as e:
        yield _sse(from_generation_error(e, g.param_aliases).body())
    finally:
        _cancel(stream)  # the client went away mid-stream (this generator cancelled or closed)
    yield "data: [DONE]\n\n"
