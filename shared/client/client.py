"""Python client for `pdserve.v1.Generation`, sync (`Client`) and asyncio (`AsyncClient`).

    with Client("localhost:50051") as c:
        for chunk in c.generate("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="")
        reply = c.complete(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32)
        done = c.complete([1, 2, 3], max_tokens=8)  # .text, .finish_reason, .usage, .token_ids

Sampling keywords are the proto's SamplingParams fields (max_tokens, temperature, top_p, top_k, min_p,
seed, stop, stop_token_ids, ignore_eos). Failures raise `GenerationError` with the gRPC status code and,
for INVALID_ARGUMENT, the field violations. A call made inside an OpenTelemetry span carries its
W3C `traceparent`, so the server's spans join the caller's trace.

A service that serves TLS or asks for a bearer token: `Client(target, credentials=...)` with
`Credentials.from_files(tls_ca=..., tls_cert=..., tls_key=..., token_file=...)` (shared/client/
credentials.py). A call's `token=` replaces the client's token for that call alone (the OpenAI front
forwards each HTTP caller's key that way).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
from opentelemetry import propagate

from shared.client.credentials import CallAuth, Credentials, aio_channel
from shared.client.credentials import channel as sync_channel
from shared.client.errors import FieldViolation, field_violations
from shared.pb.pdserve.v1 import generation_pb2 as pb
from shared.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Chunk",
    "Client",
    "Completion",
    "Credentials",
    "GenerationError",
    "Message",
    "Stream",
    "Usage",
]

_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, read from the server's prefix cache


class Completion(NamedTuple):
    text: str
    finish_reason: str
    usage: Usage
    token_ids: tuple[int, ...] = ()


class GenerationError(Exception):
    def __init__(self, err: grpc.RpcError) -> None:
        self.code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
        self.details: str = err.details() or ""  # type: ignore[attr-defined]
        self.violations: list[FieldViolation] = field_violations(err)
        super().__init__(f"{self.code.name}: {self.details}")


def _trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The caller's current trace context as W3C `traceparent` metadata (None outside any span)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)  # the globally configured propagator (OTEL_PROPAGATORS; W3C by default)
    return tuple(carrier.items()) or None


def _call(auth: CallAuth, token: str | None) -> dict[str, Any]:
    """A call's keywords: the trace context, and the token (`token`, else the client's)."""
    return auth.call_kwargs(_trace_metadata(), token)


def _check_channel(channel: object, credentials: Credentials | None) -> None:
    if channel is not None and credentials is not None and credentials.tls is not None:
        raise TypeError("give TLS credentials or a channel of your own (with its TLS), not both")


Message = Mapping[str, str]  # {"role": ..., "content": ...}, as OpenAI's chat API


def build_request(
    prompt: str | Sequence[int] | None = None,
    request_id: str = "",
    *,
    messages: Sequence[Message] | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """The request for a prompt (text, encoded by the server, or token ids) or, with `messages`, a
    conversation the server renders with the model's chat template."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters {sorted(unknown)}; known: {sorted(_SAMPLING_FIELDS)}")
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt (text or token ids) and messages")
    params = pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    if messages is not None:
        chat = pb.ChatMessages(
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        )
        return pb.GenerateRequest(request_id=request_id, messages=chat, sampling=params)
    if isinstance(prompt, str):
        return pb.GenerateRequest(request_id=request_id, text=prompt, sampling=params)
    assert prompt is not None
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=list(prompt)), sampling=params)


class _Result:
    """Filled in from the stream as it goes: what `Stream` / `AsyncStream` expose after the loop."""

    def __init__(self) -> None:
        self.request_id = ""
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def take(self, msg: pb.GenerateResponse) -> Chunk | None:
        self.request_id = msg.request_id
        if msg.WhichOneof("response") == "chunk":
            return Chunk(tuple(msg.chunk.token_ids), msg.chunk.text)
        u = msg.complete.usage
        self.finish_reason = msg.complete.finish_reason
        self.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
        return None


class Stream(_Result):
    """Iterate for chunks; afterwards `finish_reason` and `usage` are set (None after `cancel()`)."""

    def __init__(self, call: Any) -> None:
        super().__init__()
        self._call = call
        self.cancelled = False

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for msg in self._call:
                chunk = self.take(msg)
                if chunk is not None:
                    yield chunk
        except grpc.RpcError as e:
            if self.cancelled and e.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                return  # our own cancel() ends the iteration; finish_reason stays None
            raise GenerationError(e) from e

    def cancel(self) -> None:
        """Stop the request (the server aborts it and frees its KV); iteration then ends quietly."""
        self.cancelled = True
        self._call.cancel()


class AsyncStream(_Result):
    def __init__(self, call: Any) -> None:
        super().__init__()
        self._call = call
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for msg in self._call:
                chunk = self.take(msg)
                if chunk is not None:
                    yield chunk
        except asyncio.CancelledError:
            if not self.cancelled:  # the task itself is being cancelled: let that through
                raise
        except grpc.RpcError as e:
            if self.cancelled and e.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                return
            raise GenerationError(e) from e

    def cancel(self) -> None:
        """Stop the request (the server aborts it and frees its KV); iteration then ends quietly."""
        self.cancelled = True
        self._call.cancel()


def _completion(chunks: list[Chunk], stream: _Result) -> Completion:
    assert stream.finish_reason is not None and stream.usage is not None, "stream ended without Complete"
    ids = tuple(t for c in chunks for t in c.token_ids)
    return Completion("".join(c.text for c in chunks), stream.finish_reason, stream.usage, ids)


class Client:
    """`credentials`: TLS and a bearer token (None: plaintext, no token). With `channel` (your own, TLS
    or not) the credentials may carry a token alone, sent as metadata."""

    def __init__(
        self, target: str, *, channel: grpc.Channel | None = None, credentials: Credentials | None = None
    ) -> None:
        _check_channel(channel, credentials)
        self.channel = channel or sync_channel(target, credentials)
        self._stub = pb_grpc.GenerationStub(self.channel)
        self._auth = CallAuth(credentials)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        token: str | None = None,
        **sampling: Any,
    ) -> Stream:
        """Stream a completion of `prompt`, or the assistant's reply to `messages`; `token`: this call's
        bearer token instead of the client's."""
        req = build_request(prompt, request_id, messages=messages, **sampling)
        return Stream(self._stub.Generate(req, timeout=timeout, **_call(self._auth, token)))

    def complete(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """The whole generation: (text, finish_reason, usage, token_ids)."""
        stream = self.generate(prompt, **kwargs)
        return _completion(list(stream), stream)

    def abort(self, request_id: str, *, timeout: float | None = None, token: str | None = None) -> bool:
        req = pb.AbortRequest(request_id=request_id)
        try:
            return self._stub.Abort(req, timeout=timeout, **_call(self._auth, token)).found
        except grpc.RpcError as e:
            raise GenerationError(e) from e

    def model_info(self, *, timeout: float | None = None, token: str | None = None) -> pb.ModelInfo:
        req = pb.GetModelInfoRequest()
        try:
            return self._stub.GetModelInfo(req, timeout=timeout, **_call(self._auth, token))
        except grpc.RpcError as e:
            raise GenerationError(e) from e

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """Create inside a running event loop (grpc.aio channels belong to one)."""

    def __init__(
        self, target: str, *, channel: grpc.aio.Channel | None = None, credentials: Credentials | None = None
    ) -> None:
        _check_channel(channel, credentials)
        self.channel = channel or aio_channel(target, credentials)
        self._stub = pb_grpc.GenerationStub(self.channel)
        self._auth = CallAuth(credentials)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        token: str | None = None,
        **sampling: Any,
    ) -> AsyncStream:
        """Stream a completion of `prompt`, or the assistant's reply to `messages`; `token`: this call's
        bearer token instead of the client's."""
        req = build_request(prompt, request_id, messages=messages, **sampling)
        return AsyncStream(self._stub.Generate(req, timeout=timeout, **_call(self._auth, token)))

    async def complete(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        stream = self.generate(prompt, **kwargs)
        chunks = [c async for c in stream]
        return _completion(chunks, stream)

    async def abort(self, request_id: str, *, timeout: float | None = None, token: str | None = None) -> bool:
        req = pb.AbortRequest(request_id=request_id)
        try:
            return (await self._stub.Abort(req, timeout=timeout, **_call(self._auth, token))).found
        except grpc.RpcError as e:
            raise GenerationError(e) from e

    async def model_info(self, *, timeout: float | None = None, token: str | None = None) -> pb.ModelInfo:
        req = pb.GetModelInfoRequest()
        try:
            return await self._stub.GetModelInfo(req, timeout=timeout, **_call(self._auth, token))
        except grpc.RpcError as e:
            raise GenerationError(e) from e

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
