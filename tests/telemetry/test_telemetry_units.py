"""Exporter selection from OTEL_* variables, traceparent round trip, the fault hook's parsing."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from invariants import Severity, Violation
from shared.serving import faults
from shared.serving.metrics import Metrics
from shared.serving.telemetry import Telemetry, extract_context, inject_context, provider_from_env


def test_no_exporter_configured_means_no_tracer() -> None:
    assert provider_from_env("decode", {}) is None
    assert provider_from_env("decode", {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert not Telemetry("decode", provider_from_env("decode", {})).tracing
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}
    assert provider_from_env("decode", env) is None


def test_exporters_from_env() -> None:
    p = provider_from_env("prefill", {"OTEL_TRACES_EXPORTER": "console"})
    assert p is not None and p.resource.attributes["service.name"] == "pdserve-prefill"
    p.shutdown()
    for proto in ("grpc", "http/protobuf"):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": proto}
        p = provider_from_env("decode", {**env, "OTEL_SERVICE_NAME": "dec"})
        assert p is not None and p.resource.attributes["service.name"] == "dec"
        p.shutdown()
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        provider_from_env("decode", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "x"})


def test_traceparent_round_trip() -> None:
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("s") as span:
        md = inject_context()
    assert [k for k, _ in md] == ["traceparent"]
    ctx = extract_context(md)
    from opentelemetry import trace

    assert trace.get_current_span(ctx).get_span_context().trace_id == span.get_span_context().trace_id
    assert inject_context(extract_context([])) == []


def test_unattributed_violation_gets_a_service_span_and_is_counted() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = Metrics("decode")
    tel = Telemetry("decode", provider, metrics)
    tel.violation(Violation("swa.history_present", Severity.FATAL_CONTAINABLE, 2, 5, (1,)), ("gone",))
    (span,) = exporter.get_finished_spans()
    assert span.name == "pdserve.decode.invariants"
    (event,) = span.events
    assert event.name == "invariant.violation" and event.attributes["invariant.total_hits"] == 5
    labels = {"invariant": "swa.history_present", "severity": "fatal_containable", "service": "decode"}
    assert metrics.registry.get_sample_value("pdserve_invariant_hits_total", labels) == 2


def test_fault_spec() -> None:
    assert faults.from_env({}) is None
    assert faults.from_env({faults.ENV_VAR: "drop_swa_history"}) == faults.Faults(faults.DEFAULT_MARKER)
    assert faults.from_env({faults.ENV_VAR: "drop_swa_history:9"}) == faults.Faults(9)
    with pytest.raises(ValueError, match="unknown fault"):
        faults.from_env({faults.ENV_VAR: "melt"})
