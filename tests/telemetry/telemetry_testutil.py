"""Real service processes with the test span exporter (PDSERVE_TEST_SPAN_FILE) and /metrics on a free
port: spans are read back as JSON lines, metrics scraped over HTTP and parsed by prometheus_client."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from prefill_service.servicer import SERVICE_NAME as PREFILL
from tests.services.service_testutil import ServerProcess, random_spec

COMMON = ("--page-size", "4", "--max-running", "4")
Span = dict[str, Any]


def start(module: str, spans: Path, level: str, *args: str, **env: str) -> ServerProcess:
    service = {"service": PREFILL} if module == "prefill_service" else {}
    return ServerProcess(
        random_spec(), *COMMON, *args, module=module, **service,
        env={"PDSERVE_TEST_SPAN_FILE": str(spans), "PDSERVE_INVARIANT_CHECK": level, **env},
    )  # fmt: skip


def read_spans(path: Path) -> list[Span]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_spans(path: Path, pred: Callable[[list[Span]], bool], timeout: float = 10) -> list[Span]:
    deadline = time.monotonic() + timeout
    while True:
        spans = read_spans(path)
        if pred(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def metrics_url(proc: ServerProcess, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.lines:
            if " metrics on " in line:
                return f"http://{line.rsplit(' ', 1)[1]}/metrics"
        time.sleep(0.05)
    raise AssertionError(f"no metrics line in {proc.lines}")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name` over the series whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
