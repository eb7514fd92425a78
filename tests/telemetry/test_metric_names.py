"""The services' /metrics passes `promtool check metrics`. promtool is not installable here, so its
linter's rules (prometheus/client_golang's promlint, which promtool runs) are written out below and run
on what prometheus_client's own HTTP server serves for every series the services export."""

from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.serving.metrics import Metrics, serve_metrics
from shared.serving.scheduler_types import PoolState

# promlint's unit checks: abbreviations, and units that are not Prometheus' base units.
ABBREVIATED = {"s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d"}
NOT_BASE = {
    "milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "days", "weeks", "millis",
    "kilobytes", "megabytes", "gigabytes", "terabytes", "bits", "percent", "percentage", "celsius",
}  # fmt: skip
TYPE_WORDS = {"counter", "gauge", "histogram", "summary"}
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def promlint(text: str) -> list[str]:
    """promtool check metrics' problems with an exposition text, one line each (none: clean)."""
    problems = []
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = dict(re.findall(r"^# HELP (\S+) ?(.*)$", text, re.M))
    for name, kind in types.items():
        words = name.split("_")
        if not helps.get(name):
            problems.append(f"{name}: no help text")
        if ":" in name:
            problems.append(f"{name}: metric names should not contain ':'")
        if name != name.lower():
            problems.append(f"{name}: metric names should be written in 'snake_case' not 'camelCase'")
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f'{name}: counter metrics should have "_total" suffix')
        if kind != "counter" and name.endswith("_total"):
            problems.append(f'{name}: non-counter metrics should not have "_total" suffix')
        if kind not in ("histogram", "summary") and name.endswith(HISTOGRAM_SUFFIXES):
            problems.append(
                f"{name}: non-histogram and non-summary metrics should not have a reserved suffix"
            )
        problems += [
            f"{name}: metric names should not contain abbreviated units ({w})"
            for w in words
            if w in ABBREVIATED
        ]
        problems += [f"{name}: use base units instead of {w}" for w in words if w in NOT_BASE]
        problems += [f"{name}: metric name should not include type '{w}'" for w in words if w in TYPE_WORDS]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for label in s.labels:
                if label == "le" and family.type != "histogram":
                    problems.append(f'{s.name}: non-histogram metrics should not have "le" label')
                if label != label.lower():
                    problems.append(f"{s.name}: label names should be written in 'snake_case' ({label})")
    return sorted(set(problems))


def test_the_linter_catches_what_promtool_does() -> None:
    bad = """# HELP pdserve_kv_pages_total KV pool pages
# TYPE pdserve_kv_pages_total gauge
pdserve_kv_pages_total 512
# HELP pdserve_requests Requests
# TYPE pdserve_requests counter
pdserve_requests 3
# HELP pdserve_step_time_ms Step time
# TYPE pdserve_step_time_ms gauge
pdserve_step_time_ms 3
# HELP pdserve:ttft_milliseconds TTFT
# TYPE pdserve:ttft_milliseconds gauge
pdserve:ttft_milliseconds 3
"""
    found = promlint(bad)
    for expected in ('pdserve_kv_pages_total: non-counter metrics should not have "_total"',
                     'pdserve_requests: counter metrics should have "_total"', "abbreviated units (ms)",
                     "should not contain ':'", "instead of milliseconds"):  # fmt: skip
        assert any(expected in p for p in found), (expected, found)


@pytest.fixture
def exposition() -> str:
    """Every series the services export, each with a sample, as prometheus_client's server serves it."""
    m = Metrics("decode")
    m.bind_model("SmolLM2-135M-Instruct")
    m.watch_pool(
        lambda: PoolState(pages_total=8, pages_free=6, slots_total=2, slots_free=1, running=1, waiting=0)
    )
    m.watch_prefill(lambda: True, lambda: 100, lambda: 4096)
    for h in (m.ttft, m.itl, m.e2e, m.queue, m.prefill):
        h.observe(0.01)
    m.finished("length", 10, 5)
    m.transfer("inline", "receive", 1 << 20, 0.01)
    m.prefill_route("remote", "remote")
    m.prefill_refused()
    m.invariant_hits("swa.history_present", "fatal_containable", 1)
    port = serve_metrics(m, "127.0.0.1", 0, "decode")  # 0: any free port
    assert port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_every_series_passes_promtool_check_metrics(exposition: str) -> None:
    assert promlint(exposition) == []


def test_every_series_has_the_prefix_and_the_model_name(exposition: str) -> None:
    families = list(text_string_to_metric_families(exposition))
    assert len(families) >= 20
    for family in families:
        assert family.name.startswith("pdserve_"), family.name
        for s in family.samples:
            assert s.labels.get("model_name") == "SmolLM2-135M-Instruct", s
            assert s.labels.get("service") == "decode", s
    assert "pdserve_kv_pages_capacity 8.0" in exposition.replace(
        '{model_name="SmolLM2-135M-Instruct",service="decode"}', ""
    )
