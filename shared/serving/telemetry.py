"""OpenTelemetry tracing for one service process: exporters from the standard OTEL_* variables, W3C
`traceparent` over gRPC metadata, and invariant violations as span events.

Exporters (`OTEL_TRACES_EXPORTER`, comma separated): `otlp` (protocol from
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`: `grpc`, the default, or
`http/protobuf`; endpoint, headers, timeouts and batching from the exporters' own OTEL_* variables),
`console`, `none`. Unset: `otlp` when an OTLP endpoint variable is set, otherwise nothing. With no
exporter there is no tracer at all: request handlers skip every span call, so tracing off costs
nothing, and the scheduler thread never touches spans either way (it only stamps times on its events).
`PDSERVE_TEST_SPAN_FILE=PATH` (tests only) adds an exporter writing each span as a JSON line.

Spans are manual, not gRPC auto-instrumentation: the span tree names the serving phases (queue,
prefill, KV transfer, decode) and health checks stay untraced.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import invariants
from shared.serving.metrics import Metrics

__all__ = ["Telemetry", "extract_context", "inject_context", "provider_from_env"]

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
SPAN_FILE_ENV = "PDSERVE_TEST_SPAN_FILE"


def extract_context(metadata: Sequence[tuple[str, Any]] | None) -> Context:
    """The caller's trace context from gRPC invocation metadata (keys arrive lower-cased)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def inject_context(ctx: Context | None = None) -> list[tuple[str, str]]:
    """`traceparent` (and `tracestate`) metadata for an outgoing call; empty without a valid span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return list(carrier.items())


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    proto = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif proto in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {proto!r} is not grpc or http/protobuf")
    return OTLPSpanExporter()


def _processors(env: Mapping[str, str]) -> list[SpanProcessor]:
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        has_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        names = "otlp" if has_endpoint else "none"
    out: list[SpanProcessor] = []
    for name in (n.strip() for n in names.split(",")):
        if name in ("", "none"):
            continue
        if name == "otlp":
            out.append(BatchSpanProcessor(_otlp_exporter(env)))
        elif name == "console":
            out.append(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            log.warning("OTEL_TRACES_EXPORTER: unknown exporter %r ignored", name)
    if env.get(SPAN_FILE_ENV):
        from shared.serving.span_file import JsonLinesExporter

        out.append(SimpleSpanProcessor(JsonLinesExporter(env[SPAN_FILE_ENV])))
    return out


def provider_from_env(role: str, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A TracerProvider for `role` with the exporters the environment names; None when there are none."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    processors = _processors(env)
    if not processors:
        return None
    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME (which wins over ours).
    attrs = {"service.name": env.get("OTEL_SERVICE_NAME") or f"pdserve-{role}", "pdserve.role": role}
    provider = TracerProvider(resource=Resource.create(attrs))
    for p in processors:
        provider.add_span_processor(p)
    return provider


class Telemetry:
    """One service's tracer and metrics, and the live request spans invariant events attach to.

    Everything here runs on the event loop, except `Metrics` counters, which are thread-safe.
    """

    def __init__(self, role: str, provider: TracerProvider | None = None, metrics: Metrics | None = None):
        self.role = role
        self.provider = provider
        self.tracer: trace.Tracer | None = provider.get_tracer("pdserve") if provider is not None else None
        self.metrics = metrics
        self.service_name = (
            str(provider.resource.attributes.get("service.name")) if provider else f"pdserve-{role}"
        )
        self._live: dict[str, trace.Span] = {}  # request id -> its server span (event loop only)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, role: str, metrics: Metrics | None = None) -> Telemetry:
        return cls(role, provider_from_env(role), metrics)

    @property
    def tracing(self) -> bool:
        return self.tracer is not None

    def register(self, rid: str, span: trace.Span) -> None:
        with self._lock:
            self._live[rid] = span

    def unregister(self, rid: str) -> None:
        with self._lock:
            self._live.pop(rid, None)

    def violation(self, v: invariants.Violation, rids: Sequence[str]) -> None:
        """Record one violation: counted, and an `invariant.violation` event on the spans of the requests
        it is attributed to, or on a per-service span when none of them is live. Any thread."""
        if self.metrics is not None:
            self.metrics.invariant_hits(v.name, v.severity.value, v.new_hits)
        if self.tracer is None:
            return
        try:
            level = invariants.level_of(invariants.get(v.name)).value
        except KeyError:
            level = "unknown"
        attrs = {
            "invariant.name": v.name,
            "invariant.severity": v.severity.value,
            "invariant.level": level,
            "invariant.new_hits": v.new_hits,
            "invariant.total_hits": v.total,
            "service.name": self.service_name,
        }
        with self._lock:
            spans = [self._live[r] for r in rids if r in self._live]
        for span in spans:
            span.add_event("invariant.violation", {**attrs, "invariant.rows": list(v.rows)})
        if not spans:
            with self.tracer.start_as_current_span(f"pdserve.{self.role}.invariants", context=Context()) as s:
                s.add_event("invariant.violation", {**attrs, "invariant.rows": list(v.rows)})

    def shutdown(self) -> None:
        """Flush and stop the exporters (at process exit)."""
        if self.provider is not None:
            self.provider.shutdown()
