"""The server interceptor every call passes before a servicer sees it.

In order, for every method but grpc.health.v1 (probes carry no token, and the kubelet's carry no
certificate name; the TLS handshake itself still applies to them):
1. the caller's certificate names one of --tls-client-names, when set (prefill: only decode may call
   the internal API that takes KV handles and writes into pools), else PERMISSION_DENIED;
2. a bearer token from the token list, when there is one, else UNAUTHENTICATED; the identity it names
   (or the certificate's, or none) is what `caller()` returns to the servicer (Abort checks ownership).
Then, for methods that take one request message (all but reflection's stream):
3. the message must arrive within --first-message-timeout (a call that opens a stream and never sends
   its request holds a call slot and memory forever otherwise): DEADLINE_EXCEEDED;
4. at most --max-request-bytes: INVALID_ARGUMENT naming the limit (gRPC itself refuses, with
   RESOURCE_EXHAUSTED, what is more than twice over, before reading it);
5. it must parse: INVALID_ARGUMENT without internals, and one log line a minute at most however many
   malformed calls come (gRPC's own answer is UNKNOWN naming a Python class, plus a traceback per call).

To do 3-5 the interceptor serves such a method as a stream-request one and reads the message itself:
the two are the same on the wire (a client sends one message and half-closes either way).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from shared.serving.security.tls import peer_names
from shared.serving.security.tokens import Identity, Tokens

__all__ = ["Guard", "GuardConfig", "caller"]

log = logging.getLogger("pdserve.guard")
_OPEN = ("/grpc.health.v1.Health/",)
_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("pdserve_caller", default=None)
_SHOWN = 80  # characters of caller-supplied text an error message repeats


def caller() -> Identity | None:
    """The identity of the call this coroutine serves (None: anonymous, no auth configured)."""
    return _CALLER.get()


class _RateLimitedLog:
    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._last = -every_s
        self._quiet = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._quiet += 1
            return
        more = f" ({self._quiet} more since the last report)" if self._quiet else ""
        log.warning(msg + more, *args)
        self._last, self._quiet = now, 0


class GuardConfig:
    """What the guard enforces (built from the service's flags by shared/serving/runtime.py)."""

    def __init__(
        self, *, tokens: Tokens | None = None, client_names: tuple[str, ...] = (),
        first_message_timeout: float = 10.0, max_request_bytes: int = 4 << 20,
    ) -> None:  # fmt: skip
        self.tokens = tokens
        self.client_names = frozenset(client_names)
        self.first_message_timeout = first_message_timeout
        self.max_request_bytes = max_request_bytes


class Guard(grpc.aio.ServerInterceptor):
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._malformed = _RateLimitedLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler  # UNIMPLEMENTED, as gRPC answers it
        method = details.method
        open_ = method.startswith(_OPEN)
        if handler.request_streaming:
            return _streaming(handler, lambda ctx: self._admit(method, open_, ctx))
        parse = handler.request_deserializer or (lambda raw: raw)

        async def receive(context: grpc.aio.ServicerContext) -> tuple[Any, Identity | None]:
            who = await self._admit(method, open_, context)
            return await self._read(method, parse, context), who

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                request, who = await receive(context)
                _CALLER.set(who)
                return await inner_uu(request, context)

            return grpc.stream_unary_rpc_method_handler(unary, None, handler.response_serializer)
        inner_us = handler.unary_stream

        async def stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request, who = await receive(context)
            _CALLER.set(who)
            async for message in _relay(inner_us(request, context)):
                yield message

        return grpc.stream_stream_rpc_method_handler(stream, None, handler.response_serializer)

    async def _admit(self, method: str, open_: bool, context: grpc.aio.ServicerContext) -> Identity | None:
        """The caller's identity, or the call ends here (PERMISSION_DENIED, UNAUTHENTICATED)."""
        if open_:
            return None
        cfg = self.config
        names = peer_names(context) if cfg.client_names or cfg.tokens is None else set()
        if cfg.client_names and not names & cfg.client_names:
            shown = ", ".join(sorted(names))[:_SHOWN] or "no certificate names"
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: the caller's certificate ({shown}) is not one this service accepts "
                "(--tls-client-names)",
            )
        if cfg.tokens is None:
            return Identity(min(names)) if names else None
        bearer = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        if bearer is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing credentials: send `authorization: Bearer <token>`"
            )
        scheme, _, token = str(bearer).partition(" ")
        who = cfg.tokens.identify(token.strip()) if scheme.lower() == "bearer" else None
        if who is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return who

    async def _read(
        self, method: str, parse: Callable[[bytes], Any], context: grpc.aio.ServicerContext
    ) -> Any:
        cfg = self.config
        try:
            raw = await asyncio.wait_for(context.read(), cfg.first_message_timeout)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no request message within {cfg.first_message_timeout:g}s of the call's start "
                "(--first-message-timeout)",
            )
        if raw is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message")
        if len(raw) > cfg.max_request_bytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is {len(raw)} bytes, over the limit of {cfg.max_request_bytes} "
                "(--max-request-bytes)",
            )
        try:
            return parse(raw)
        except Exception as e:  # DecodeError, or whatever a deserializer raises on bytes it cannot read
            self._malformed.warning("%s: malformed request refused (%s)", method, type(e).__name__)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {method} message"
            )


def _streaming(
    handler: grpc.RpcMethodHandler, admit: Callable[[grpc.aio.ServicerContext], Awaitable[Identity | None]]
) -> grpc.RpcMethodHandler:
    """A stream-request method (server reflection): the caller checks only; it reads its own stream."""
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            _CALLER.set(await admit(context))
            return await inner_su(request_iterator, context)

        return grpc.stream_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
    inner_ss = handler.stream_stream

    async def stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        _CALLER.set(await admit(context))
        async for message in _relay(inner_ss(request_iterator, context)):
            yield message

    return grpc.stream_stream_rpc_method_handler(
        stream, handler.request_deserializer, handler.response_serializer
    )


async def _relay(out: Any) -> AsyncIterator[Any]:
    """A streaming handler's messages: an async generator's, or none from one that writes with
    context.write() itself."""
    if inspect.isasyncgen(out):
        async for message in out:
            yield message
    else:
        await out
