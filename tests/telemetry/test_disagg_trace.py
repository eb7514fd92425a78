"""One trace per request across both services, and invariant WARN events on the hurt request's span.

A prefill and a decode process (every prompt remote) at PDSERVE_INVARIANT_CHECK=warn, with the test
fault that drops the SWA history of prompts starting with token 3, both exporting spans as JSON lines.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.client.client import Client, GenerationError
from tests.services.service_testutil import ServerProcess, stop_all, wait_pool_idle
from tests.telemetry.telemetry_testutil import Span, metrics_url, sample, scrape, start, wait_spans

MARKER = 3
GREEDY = {"temperature": 0.0, "ignore_eos": True}
HEALTHY = [5 + (7 * i) % 90 for i in range(13)]  # longer than the window (8): history matters
HURT = [MARKER, *HEALTHY[1:]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess, Path]]:
    spans = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    pf = start("prefill_service", spans, "warn")
    try:
        dec = start(
            "decode_service", spans, "warn", "--prefill-target", pf.target, "--local-prefill-max-tokens", "0",
            PDSERVE_TEST_FAULTS=f"drop_swa_history:{MARKER}",
        )  # fmt: skip
    except BaseException:
        stop_all(pf)
        raise
    try:
        yield pf, dec, spans
    finally:
        stop_all(dec, pf)


def _by_id(spans: list[Span]) -> dict[str, Span]:
    return {s["span_id"]: s for s in spans}


def _children(spans: list[Span], parent: Span) -> dict[str, Span]:
    return {s["name"]: s for s in spans if s["parent_id"] == parent["span_id"]}


def test_one_trace_across_both_services(pair: tuple[ServerProcess, ServerProcess, Path]) -> None:
    _, dec, path = pair
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("client") as root, Client(dec.target) as c:
        _, reason, usage, _ = c.complete(HEALTHY, max_tokens=6, request_id="traced", **GREEDY)
    assert reason == "length" and usage.completion_tokens == 6
    trace_id = f"{root.get_span_context().trace_id:032x}"
    want = {"pdserve.v1.Generation/Generate", "pdserve.v1.Prefill/Prefill", "kv.transfer", "decode"}

    def done(spans: list[Span]) -> bool:
        names = [s["name"] for s in spans if s["trace_id"] == trace_id]
        return (
            want <= set(names)
            and names.count("pdserve.v1.Prefill/Prefill") == names.count("kv.transfer") == 2
        )

    spans = [s for s in wait_spans(path, done) if s["trace_id"] == trace_id]
    assert done(spans), [s["name"] for s in spans]
    by_id = _by_id(spans)
    # Decode's server span is the client span's child; every other span hangs under it.
    gen = next(s for s in spans if s["name"] == "pdserve.v1.Generation/Generate")
    assert gen["kind"] == "SERVER" and gen["parent_id"] == f"{root.get_span_context().span_id:016x}"
    assert gen["service"] == "pdserve-decode" and gen["status"] == "UNSET"
    a = gen["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 1.0
    assert a["gen_ai.usage.input_tokens"] == len(HEALTHY) and a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.response.id"] == "traced"
    assert a["pdserve.queue_time_s"] >= 0 and a["pdserve.time_to_first_token_s"] > 0
    kids = _children(spans, gen)
    assert {"queue", "pdserve.v1.Prefill/Prefill", "decode"} <= set(kids)
    call = kids["pdserve.v1.Prefill/Prefill"]
    assert call["kind"] == "CLIENT"
    # The prefill service's server span continues the trace under decode's client span.
    served = next(s for s in spans if s["name"] == "pdserve.v1.Prefill/Prefill" and s["kind"] == "SERVER")
    assert served["parent_id"] == call["span_id"] and served["service"] == "pdserve-prefill"
    assert {"queue", "prefill.forward", "kv.extract", "kv.transfer"} <= set(_children(spans, served))
    for side, parent in (("receive", call), ("send", served)):
        kv = _children(spans, parent)["kv.transfer"]
        ka = kv["attributes"]
        assert ka["pdserve.kv.backend"] == "inline" and ka["pdserve.kv.direction"] == side
        assert ka["pdserve.kv.bytes"] > 0 and ka["pdserve.kv.duration_s"] > 0 and ka["pdserve.kv.gbps"] > 0
    assert all(s["parent_id"] in by_id or s is gen for s in spans)
    # Health checks are not traced.
    assert not [s for s in wait_spans(path, lambda _: False, 0) if "Health" in s["name"]]


def test_warn_violation_lands_on_the_hurt_request_only(
    pair: tuple[ServerProcess, ServerProcess, Path],
) -> None:
    _, dec, path = pair
    url = metrics_url(dec)
    before = scrape(url)
    with Client(dec.target) as c:
        expected = c.complete(HEALTHY, max_tokens=24, **GREEDY).token_ids
        stream = c.generate(HEALTHY, max_tokens=24, request_id="healthy", **GREEDY)
        it = iter(stream)
        got = list(next(it).token_ids)  # the healthy request runs before and after the hurt one
        errors: list[GenerationError] = []

        def hurt() -> None:
            try:
                c.complete(HURT, max_tokens=24, request_id="hurt", **GREEDY)
            except GenerationError as e:
                errors.append(e)

        t = threading.Thread(target=hurt)
        t.start()
        t.join(30)
        for chunk in it:
            got += chunk.token_ids
        assert stream.finish_reason == "length" and tuple(got) == tuple(expected)
        assert len(errors) == 1, "the hurt request must fail"
        assert errors[0].code == grpc.StatusCode.INTERNAL and "swa.history_present" in errors[0].details
        wait_pool_idle(c)  # its pages and window came back
        # Alone: the step in flight when it was contained still completes and frees its pages.
        with pytest.raises(GenerationError, match=r"swa\.history_present"):
            c.complete(HURT, max_tokens=24, request_id="hurt-alone", **GREEDY)
        wait_pool_idle(c)

    def hurt_span(spans: list[Span]) -> Span | None:
        return next((s for s in spans if s["attributes"].get("gen_ai.response.id") == "hurt"
                     and s["kind"] == "SERVER" and s["service"] == "pdserve-decode"), None)  # fmt: skip

    spans = wait_spans(path, lambda sp: hurt_span(sp) is not None)
    span = hurt_span(spans)
    assert span is not None and span["status"] == "ERROR" and "swa.history_present" in span["status_message"]
    events = [e for e in span["events"] if e["name"] == "invariant.violation"]
    assert events, span["events"]
    ea = events[0]["attributes"]
    assert ea["invariant.name"] == "swa.history_present" and ea["invariant.severity"] == "fatal_containable"
    assert ea["invariant.level"] == "warn" and ea["invariant.new_hits"] >= 1
    assert ea["invariant.total_hits"] >= ea["invariant.new_hits"] and ea["service.name"] == "pdserve-decode"
    healthy = [s for s in spans if s["attributes"].get("gen_ai.response.id") in ("healthy", "traced")]
    assert healthy and not any(e["name"] == "invariant.violation" for s in healthy for e in s["events"])
    after = scrape(url)
    hits = dict(invariant="swa.history_present", severity="fatal_containable", service="decode")
    assert sample(after, "pdserve_invariant_hits_total", **hits) > sample(
        before, "pdserve_invariant_hits_total", **hits
    )
    err = dict(service="decode", finish_reason="error")
    assert (
        sample(after, "pdserve_requests_total", **err) == sample(before, "pdserve_requests_total", **err) + 2
    )
