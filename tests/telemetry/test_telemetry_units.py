"""Exporter selection from OTEL_* variables, traceparent round trip, the fault hook's parsing."""

from __future__ import annotations

import os

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from invariants import Severity, Violation
from shared.serving import faults
from shared.serving.metrics import Metrics
from shared.serving.telemetry import Telemetry, extract_context, inject_context, provider_from_env


def _env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """Exactly these OTEL_* variables (the SDK reads os.environ)."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_no_exporter_configured_means_no_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch)
    assert provider_from_env("decode") is None
    assert not Telemetry("decode", provider_from_env("decode")).tracing
    _env(monkeypatch, OTEL_TRACES_EXPORTER="none", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1")
    assert provider_from_env("decode") is None
    _env(monkeypatch, OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true")
    assert provider_from_env("decode") is None


def _exporters(p: TracerProvider) -> list[SpanExporter]:
    return [sp.span_exporter for sp in p._active_span_processor._span_processors]  # type: ignore[attr-defined]


def test_exporters_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch, OTEL_TRACES_EXPORTER="console")
    p = provider_from_env("prefill")
    assert p is not None and p.resource.attributes["service.name"] == "pdserve-prefill"
    assert [type(e) for e in _exporters(p)] == [ConsoleSpanExporter]
    p.shutdown()
    for proto, exporter in (("grpc", GrpcExporter), ("http/protobuf", HttpExporter)):
        # No OTEL_TRACES_EXPORTER but an endpoint: otlp, over the protocol the SDK reads
        _env(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1", OTEL_EXPORTER_OTLP_PROTOCOL=proto)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "dec")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=other,k8s.pod.name=p0")
        p = provider_from_env("decode")
        assert p is not None and [type(e) for e in _exporters(p)] == [exporter]
        attrs = p.resource.attributes  # OTEL_SERVICE_NAME over OTEL_RESOURCE_ATTRIBUTES over ours
        assert (
            attrs["service.name"] == "dec"
            and attrs["k8s.pod.name"] == "p0"
            and attrs["pdserve.role"] == "decode"
        )
        p.shutdown()
    _env(monkeypatch, OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="x")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        provider_from_env("decode")
    _env(monkeypatch, OTEL_TRACES_EXPORTER="zipkin-typo")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        provider_from_env("decode")


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
    labels["model_name"] = ""  # none bound: a Metrics made outside a service
    assert metrics.registry.get_sample_value("pdserve_invariant_hits_total", labels) == 2


def test_fault_spec() -> None:
    assert faults.from_env({}) is None
    assert faults.from_env({faults.ENV_VAR: "drop_swa_history"}) == faults.Faults(faults.DEFAULT_MARKER)
    assert faults.from_env({faults.ENV_VAR: "drop_swa_history:9"}) == faults.Faults(9)
    with pytest.raises(ValueError, match="unknown fault"):
        faults.from_env({faults.ENV_VAR: "melt"})
