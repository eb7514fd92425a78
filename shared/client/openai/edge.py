"""What every HTTP request meets before a handler: metrics, the API key, the body-size bound.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers streams and hides
disconnects), outermost so that refused requests (401, 413) are counted too, and a stream's latency
runs to its last byte. The key is checked before the body is read: an unauthenticated caller cannot
make the front read a large body.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from fastapi import HTTPException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.client.credentials import valid_token
from shared.client.openai.errors import APIError

__all__ = ["Edge", "Metrics", "bearer_token"]

# Seconds: 5 ms .. 120 s (a CPU test model's whole answer to a large GPU model's long one).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def endpoint(path: str) -> str:
    """The metrics label of a path: one of ENDPOINTS, or "other" (bounded cardinality)."""
    if path.startswith("/v1/models"):
        return "/v1/models"
    return path if path in ENDPOINTS else "other"


class Metrics:
    """The front's Prometheus series, in its own registry (`pdserve_openai_` prefix, no colons)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve_openai_requests", "HTTP requests by endpoint and response status",
            ("endpoint", "status"), registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "pdserve_openai_request_duration_seconds", "Request arrival to its response's last byte",
            ("endpoint",), registry=r, buckets=_BUCKETS,
        )  # fmt: skip
        self.ttft = Histogram(
            "pdserve_openai_time_to_first_token_seconds", "Request arrival to its first generated text",
            ("endpoint",), registry=r, buckets=_BUCKETS,
        )  # fmt: skip
        self.in_flight = Gauge(
            "pdserve_openai_requests_in_flight", "HTTP requests being answered", ("endpoint",), registry=r
        )
        for ep in ENDPOINTS:  # every series visible from the first scrape
            self.in_flight.labels(ep)
            self.latency.labels(ep)


class Edge:
    def __init__(self, app: ASGIApp, metrics: Metrics, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self._key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["t0"] = t0 = time.perf_counter()
        ep = endpoint(scope["path"])
        status = 500  # until a response starts: an exception that escapes is a 500
        m = self.metrics

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        m.in_flight.labels(ep).inc()
        try:
            refused = self._refuse(scope)
            if refused is not None:
                await refused.response()(scope, receive, counted_send)
            else:
                await self.app(scope, self._bounded(receive), counted_send)
        finally:
            m.in_flight.labels(ep).dec()
            m.latency.labels(ep).observe(time.perf_counter() - t0)
            m.requests.labels(ep, str(status)).inc()

    def _refuse(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        if self._key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(_bearer(given), self._key):
                msg = "missing or wrong API key: send `Authorization: Bearer <key>`"
                return APIError(401, msg, "invalid_request_error", None, "invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return _too_large(self.max_body_bytes)
        return None

    def _bounded(self, receive: Receive) -> Receive:
        """`receive`, counting body bytes (a chunked body has no Content-Length to check up front)."""
        seen = 0
        limit = self.max_body_bytes

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # FastAPI answers an HTTPException raised while it reads the body
                    raise HTTPException(413, _too_large(limit).message)
            return message

        return bounded


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (what OpenAI clients send as api_key), which
    the front forwards to decode as the gRPC bearer token; None without one, or for a key gRPC metadata
    cannot carry (decode, if it asks for a token, then answers 401 as for a missing one)."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and valid_token(key) else None


def _bearer(value: bytes) -> bytes:
    """`Bearer <key>` with the scheme's case normalised (RFC 9110: schemes are case-insensitive)."""
    scheme, _, rest = value.partition(b" ")
    return b"Bearer " + rest.strip() if scheme.lower() == b"bearer" else value


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", "invalid_request_error", None)


def state_t0(scope: dict[str, Any]) -> float:
    return scope.get("state", {}).get("t0", time.perf_counter())
