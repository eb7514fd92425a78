"""The fault at STRICT stops the decode process; at OFF nothing is detected; /metrics parses and moves.

Decode-only processes (local prefill) with the SWA-history fault on prompts that start with token 3.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from shared.client.client import Client, GenerationError
from shared.serving.runtime import EXIT_INVARIANT
from tests.services.service_testutil import stop_all, wait_pool_idle
from tests.telemetry.telemetry_testutil import metrics_url, read_spans, sample, scrape, start

MARKER = 3
GREEDY = {"temperature": 0.0, "ignore_eos": True}
HURT = [MARKER, *(5 + (7 * i) % 90 for i in range(12))]
FAULT = {"PDSERVE_TEST_FAULTS": f"drop_swa_history:{MARKER}"}


def test_strict_stops_the_process(tmp_path: Path) -> None:
    dec = start("decode_service", tmp_path / "spans.jsonl", "strict", **FAULT)
    try:
        with Client(dec.target) as c, pytest.raises(GenerationError) as err:
            c.complete(HURT, max_tokens=16, **GREEDY)
        assert "invariant-check FAILED [swa.history_present]" in err.value.details
        assert dec.wait(30) == EXIT_INVARIANT
        assert "invariant-check FAILED [swa.history_present]" in dec.log()  # its stderr
    finally:
        stop_all(dec)


def test_warn_contains_on_the_local_path(tmp_path: Path) -> None:
    dec = start("decode_service", tmp_path / "spans.jsonl", "warn", **FAULT)
    try:
        with Client(dec.target) as c:
            with pytest.raises(GenerationError) as err:
                c.complete(HURT, max_tokens=16, **GREEDY)
            assert err.value.code == grpc.StatusCode.INTERNAL and "swa.history_present" in err.value.details
            wait_pool_idle(c)
            assert c.complete(HURT[1:], max_tokens=16, **GREEDY).finish_reason == "length"  # still serving
    finally:
        stop_all(dec)


def test_off_detects_nothing(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    dec = start("decode_service", spans, "off", **FAULT)
    try:
        with Client(dec.target) as c:
            _, reason, usage, _ = c.complete(HURT, max_tokens=16, **GREEDY)
        assert reason == "length" and usage.completion_tokens == 16  # wrong tokens, unnoticed: OFF
        samples = scrape(metrics_url(dec))
        assert sample(samples, "pdserve_invariant_hits_total") == 0
    finally:
        stop_all(dec)
    assert read_spans(spans) and not any(
        e["name"] == "invariant.violation" for s in read_spans(spans) for e in s["events"]
    )


def test_metrics_parse_and_move_with_traffic(tmp_path: Path) -> None:
    dec = start("decode_service", tmp_path / "spans.jsonl", "warn")
    try:
        url = metrics_url(dec)
        before = scrape(url)
        assert not [name for name, _ in before if ":" in name or not name.startswith("pdserve_")]
        labels = (("model_name", "random"), ("service", "decode"))  # the model GetModelInfo names
        for name in ("pdserve_requests_running", "pdserve_requests_waiting", "pdserve_kv_usage_ratio"):
            assert (name, labels) in before
        assert all(dict(ls)["model_name"] == "random" for (_, ls) in before)
        assert (
            sample(before, "pdserve_kv_pages_capacity") > 0 and sample(before, "pdserve_kv_usage_ratio") == 0
        )
        n = 3
        with Client(dec.target) as c:
            for i in range(n):
                c.complete([10 + i, 11, 12, 13], max_tokens=5, **GREEDY)
            with pytest.raises(GenerationError) as err:
                c.complete([1, 2], max_tokens=0)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            # The gauges read the pool state the scheduler publishes after each step, which may come a
            # moment after a client has heard its request end.
            wait_pool_idle(c)
        after = scrape(url)
        d = dict(service="decode")
        for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
            name = f"pdserve_{h}_seconds_count"
            assert sample(after, name, **d) - sample(before, name, **d) == n, name
        itl = "pdserve_inter_token_latency_seconds_count"
        assert sample(after, itl, **d) - sample(before, itl, **d) == n * 4
        assert sample(after, "pdserve_requests_total", finish_reason="length") == n
        assert sample(after, "pdserve_tokens_total", kind="completion") == n * 5
        assert sample(after, "pdserve_requests_running") == 0
    finally:
        stop_all(dec)


def test_no_metrics_flag(tmp_path: Path) -> None:
    dec = start("decode_service", tmp_path / "spans.jsonl", "off", "--no-metrics")
    try:
        assert not [line for line in dec.lines if " metrics on " in line]
    finally:
        stop_all(dec)


def test_a_client_that_leaves_and_a_passed_deadline_are_counted_apart_from_errors(tmp_path: Path) -> None:
    dec = start("decode_service", tmp_path / "spans.jsonl", "off", PDSERVE_TEST_FAULTS="step_delay:0.2")
    try:
        url = metrics_url(dec)
        with Client(dec.target) as c:
            stream = c.generate([5, 6, 7], max_tokens=50, **GREEDY)
            next(iter(stream))  # running: its first token is out
            stream.cancel()
            with pytest.raises(GenerationError) as err:
                c.complete([5, 6, 8], max_tokens=50, timeout=1.0, **GREEDY)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_pool_idle(c)
        deadline = time.monotonic() + 10
        while True:
            m = scrape(url)
            counts = {
                r: sample(m, "pdserve_requests_total", finish_reason=r) for r in ("cancelled", "deadline")
            }
            if counts == {"cancelled": 1, "deadline": 1} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert counts == {"cancelled": 1, "deadline": 1}, {
            k: v for k, v in m.items() if "requests_total" in k[0]
        }
        assert sample(m, "pdserve_requests_total", finish_reason="error") == 0
    finally:
        stop_all(dec)
