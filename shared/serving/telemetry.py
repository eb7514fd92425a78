"""OpenTelemetry tracing for one service process: exporters from the standard OTEL_* variables, W3C
`traceparent` over gRPC metadata, and invariant violations as span events.

The OpenTelemetry SDK reads the OTEL_* variables itself (`provider_from_env`): exporters by name from
`OTEL_TRACES_EXPORTER` (comma separated: `otlp`, whose protocol `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` /
`OTEL_EXPORTER_OTLP_PROTOCOL` picks, `grpc` by default or `http/protobuf`; `otlp_proto_grpc`,
`otlp_proto_http`, `console`, `none`), the rest from each component's own variables. Unset: `otlp`
when an OTLP endpoint variable is set, otherwise nothing. With no exporter there is no tracer at all:
request handlers skip every span call, so tracing off costs nothing, and the scheduler thread never
touches spans either way (it only stamps times on its events).
`PDSERVE_TEST_SPAN_FILE=PATH` (tests only) adds an exporter writing each span as a JSON line.

Spans are manual, not gRPC auto-instrumentation: the span tree names the serving phases (queue,
prefill, KV transfer, decode) and health checks stay untraced.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk._configuration import _get_exporter_entry_point, _get_exporter_names, _import_exporters
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_SDK_DISABLED,
)
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
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


def _exporter_names() -> list[str]:
    """The SDK's own reading of OTEL_TRACES_EXPORTER (and of the OTLP protocol variables: `otlp` becomes
    the grpc or the http/protobuf exporter's entry point), with one default of ours: unset, it is `otlp`
    only when an OTLP endpoint is set (the spec's `otlp` would export to a localhost collector that is
    not there)."""
    if OTEL_TRACES_EXPORTER in os.environ:
        return _get_exporter_names("traces")
    if os.environ.get(OTEL_EXPORTER_OTLP_ENDPOINT) or os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT):
        return [_get_exporter_entry_point("otlp", "traces")]
    return []


def provider_from_env(role: str) -> TracerProvider | None:
    """A TracerProvider for `role` with the span exporters the OTEL_* environment names; None when there
    are none (or OTEL_SDK_DISABLED=true). Everything else is the SDK's own configuration: the exporters
    read OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout, TLS), BatchSpanProcessor OTEL_BSP_*, the
    TracerProvider OTEL_TRACES_SAMPLER(_ARG), and the resource OTEL_SERVICE_NAME and
    OTEL_RESOURCE_ATTRIBUTES (over our default `pdserve-<role>`). A value the SDK cannot use (an
    unknown exporter, an OTLP protocol other than grpc and http/protobuf) raises ValueError."""
    if os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return None
    try:
        exporters, _, _ = _import_exporters(_exporter_names(), [], [])
    except RuntimeError as e:  # the SDK's word for a bad value
        raise ValueError(f"OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_PROTOCOL: {e}") from e
    processors: list[SpanProcessor] = [BatchSpanProcessor(exporter()) for exporter in exporters.values()]
    if os.environ.get(SPAN_FILE_ENV):
        from shared.serving.span_file import JsonLinesExporter

        processors.append(SimpleSpanProcessor(JsonLinesExporter(os.environ[SPAN_FILE_ENV])))
    if not processors:
        return None
    ours = Resource.create({"service.name": f"pdserve-{role}", "pdserve.role": role})
    provider = TracerProvider(resource=ours.merge(OTELResourceDetector().detect()))  # the env's win
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
