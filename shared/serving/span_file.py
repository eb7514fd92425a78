"""A test-only span exporter: each finished span as one JSON line appended to a file.

Selected by `PDSERVE_TEST_SPAN_FILE=PATH` (shared/serving/telemetry.py), so tests read back the spans of
real service processes the way they would read an `InMemorySpanExporter` in-process. Not a production
exporter: the file grows without bound and is written on the exporting thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["JsonLinesExporter", "span_record"]


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """The fields the tests look at, with ids as hex strings as trace viewers show them."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
        "service": str(span.resource.attributes.get("service.name")),
    }


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), default=list) + "\n" for s in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass
